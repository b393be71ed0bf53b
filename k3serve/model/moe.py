"""Channel mixers: dense GLU MLP, shared experts, sigmoid router and (Stable Latent) MoE.

Routed experts are stacked per layer ([E, ...] tensors) as grouped-GEMM kernels want them; MXFP4
experts stay packed in memory (E2M1 pairs + one E8M0 byte per 32 inputs) and are dequantised on
use in the reference path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..ops.backend import triton_enabled
from ..ops.moe_ref import experts_ref, route
from ..ops.mxfp4 import MMA_MAX_SCALE, dequantize_mxfp4, from_mma_layout, quantize_mxfp4, to_mma_layout
from .layers import Linear, LinearGroup, RMSNorm, glu_activation, norm_kernel_on

# Decode-sized batches run the shared expert inside the routed grouped GEMMs once it has joined
# their stacks (``RoutedExperts.join_shared``); larger batches keep cuBLAS's dense GEMMs for it.
SHARED_JOIN_MAX_TOKENS = 64


class GLUMLP(nn.Module):
    """Dense MLP and shared experts: down(act(gate x, up x))."""

    def __init__(self, cfg: ModelConfig, hidden: int, inter: int, dtype: torch.dtype, device=None):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, dtype, device, tp_dim=0)
        self.up_proj = Linear(hidden, inter, dtype, device, tp_dim=0)
        self.down_proj = Linear(inter, hidden, dtype, device, tp_dim=1)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)  # one GEMM once fused
        self.act = (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(glu_activation(*self.gate_up(x), *self.act))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        E = cfg.num_experts
        # Held in the model dtype, as the checkpoints store it (bf16), and multiplied in fp32 (as HF
        # and the original code: input and weight cast to fp32): the same logits from half the
        # bytes a decode step reads (the Triton kernel upcasts in registers).
        self.weight = nn.Parameter(torch.empty(E, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(E, dtype=torch.float32, device=device),
                                                    requires_grad=False)
        groups = cfg.num_expert_group if cfg.use_grouped_topk else 1
        self.args = dict(top_k=cfg.num_experts_per_token, num_groups=groups, topk_group=cfg.topk_group if groups > 1 else 1,
                         renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor,
                         score_func=cfg.moe_router_activation_func)

    def triton_routes(self, x: torch.Tensor) -> bool:
        """Whether the Triton router serves x: partial logits, then their sum and top-k in two
        launches (instead of ~9)."""
        return self.args["num_groups"] == 1 and not torch.is_grad_enabled() and triton_enabled("MOE", x.device)

    def forward(self, x: torch.Tensor, num_shared: int = 0,
                logit_parts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, K + num_shared] fp32, ids [T, K + num_shared]): the top-K routed choices,
        then ``num_shared`` always-on experts E, E + 1, ... with weight 1 (experts joined to the
        routed stacks). ``logit_parts``: x's partial logits, already computed (``MoE.add_norm_route``)."""
        a = self.args
        if logit_parts is not None or self.triton_routes(x):
            from ..ops.moe_triton import route_triton, router_logits

            parts = logit_parts if logit_parts is not None else router_logits(x, self.weight, split=True)
            return route_triton(parts, self.e_score_correction_bias, a["top_k"], a["renormalize"], a["scaling"],
                                a["score_func"], num_shared=num_shared)
        if not torch.is_grad_enabled() and triton_enabled("MOE", x.device):
            from ..ops.moe_triton import router_logits

            logits = router_logits(x, self.weight)
        else:
            logits = F.linear(x.float(), self.weight.float())
            if self.training:  # the trainer's bias update (quantile balancing) reads the batch's scores
                self.last_logits = logits.detach()
        weights, ids = route(logits, self.e_score_correction_bias, **a)
        if not num_shared:
            return weights, ids
        shared = torch.arange(self.weight.shape[0], self.weight.shape[0] + num_shared, device=x.device)
        return (torch.cat([weights, weights.new_ones(len(x), num_shared)], 1),
                torch.cat([ids, shared.expand(len(x), -1).to(ids.dtype)], 1))


class RoutedExperts(nn.Module):
    """All E experts of one layer, stacked. w1 = gate [E, I, din], w3 = up [E, I, din],
    w2 = down [E, dout, I]; or their MXFP4 ``*_packed`` / ``*_scale`` pairs."""

    def __init__(self, cfg: ModelConfig, din: int, dtype: torch.dtype, device=None):
        super().__init__()
        E, inter = cfg.num_experts, cfg.moe_intermediate_size
        self.num_experts, self.intermediate, self.out_features = E, inter, din
        self.mxfp4 = cfg.expert_format == "mxfp4"
        self.quantized_at_load = cfg.experts_quantized_at_load  # (join_shared may then quantise the shared MLP)
        self.dtype = dtype
        self.act = (cfg.hidden_act, cfg.situ_beta, cfg.situ_linear_beta)
        shapes = {"w1": (inter, din), "w2": (din, inter), "w3": (inter, din)}
        for name, (n, k) in shapes.items():
            if self.mxfp4:
                self.register_parameter(f"{name}_packed", nn.Parameter(
                    torch.empty(E, n, k // 2, dtype=torch.uint8, device=device), requires_grad=False))
                self.register_parameter(f"{name}_scale", nn.Parameter(
                    torch.empty(E, n, k // 32, dtype=torch.uint8, device=device), requires_grad=False))
            else:
                self.register_parameter(name, nn.Parameter(torch.empty(E, n, k, dtype=dtype, device=device),
                                                           requires_grad=False))
                self.register_buffer(f"{name}_joined", None, persistent=False)  # [E + S, n, k]: join_shared
        self.num_shared = 0  # shared experts appended to the stacks as experts E, E + 1, ...
        self.mma_layout = False  # MXFP4 stacks rewritten by use_mma_layout
        self.folded_scales = False  # every E8M0 byte <= MMA_MAX_SCALE and K % 128 == 0: moe_gluon may serve

    def join_shared(self, mlp: GLUMLP) -> bool:
        """Append the shared MLP to the stacks as expert E, so that with an always-on assignment of
        weight 1 the routed grouped GEMMs compute it too: at decode that saves the shared MLP's
        three launches a layer (gate/up GEMM, GLU, down GEMM) and its add. Only where it is the
        same computation: one shared expert of the routed width and activation, no tensor
        parallelism; bf16 stacks, or MXFP4 ones quantised at load (``--quantization mxfp4``: the
        shared expert is then quantised too, and the caller drops its bf16 MLP). bf16: the shared
        weights become views of the joined stacks (held once); the routed ones stay views too, so
        loads and the reference path see the same memory. Returns whether it joined."""
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        I, d = self.intermediate, self.out_features
        if (self.num_shared or mlp.act != self.act or tuple(gate.weight.shape) != (I, d)
                or tuple(down.weight.shape) != (d, I) or any(m.tp_size > 1 for m in (gate, up, down))
                or (self.mxfp4 and (not self.quantized_at_load or self.mma_layout))
                or (not self.mxfp4 and gate.weight.dtype != self.w1.dtype)):
            return False
        if self.mxfp4:
            for name, member in (("w1", gate), ("w3", up), ("w2", down)):
                codes, scales = quantize_mxfp4(member.weight.detach())
                for kind, t in (("packed", codes), ("scale", scales)):
                    stack = getattr(self, f"{name}_{kind}")
                    stack.data = torch.cat([stack.detach(), t[None]])
            self.num_shared = 1
            return True
        for name, member in (("w1", gate), ("w3", up), ("w2", down)):
            routed = getattr(self, name)
            stack = torch.cat([routed.detach(), member.weight.detach()[None]])
            routed.data, member.weight.data = stack[:-1], stack[-1]
            setattr(self, f"{name}_joined", stack)
        self.num_shared = 1
        return True

    def use_mma_layout(self) -> bool:
        """For serving on Hopper, after the weights are loaded: rewrite the MXFP4 stacks in place
        into the layout the grouped GEMM's register upcast reads without shuffles
        (``mxfp4.to_mma_layout``; same shapes and bytes, so nothing is held twice). Only where it
        applies: MXFP4 with rows in multiples of 16. Returns whether it rewrote; the reference
        path reads either layout."""
        if not self.mxfp4 or self.mma_layout:
            return False
        stacks = [getattr(self, f"{n}_packed") for n in ("w1", "w2", "w3")]
        if any(p.shape[-2] % 16 or p.shape[-1] % 16 for p in stacks):
            return False
        for p in stacks:  # a few experts at a time: the rewrite's temporaries are ~10x its input
            for i in range(0, p.shape[0], 16):
                p.data[i:i + 16] = to_mma_layout(p.data[i:i + 16])
        self.mma_layout = True
        # The Gluon kernel folds each block scale into the upcast (2^(E8M0 - 1) as a bf16) and
        # streams K in steps of 128 codes: checked once here, not per step.
        scales = [getattr(self, f"{n}_scale") for n in ("w1", "w2", "w3")]
        self.folded_scales = all(p.shape[-1] * 2 % 128 == 0 for p in stacks) and \
            all(int(s.max()) <= MMA_MAX_SCALE for s in scales)
        return True

    def use_mma_layout_where_faster(self) -> bool:
        """``use_mma_layout`` on Hopper-class GPUs when ``moe_triton.MMA_LAYOUT`` asks for it (the
        layout's upcast ends in sm_90's mul.bf16x2)."""
        from ..ops import moe_triton

        p = getattr(self, "w1_packed", None)
        if not (moe_triton.MMA_LAYOUT and p is not None and p.is_cuda and moe_triton.has_bf16x2_mul(p.device)):
            return False
        return self.use_mma_layout()

    def stack(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weights, scales or None) of ``name`` in w1 / w2 / w3 over every expert the grouped
        GEMMs index: the routed ones, then any joined shared expert."""
        if self.mxfp4:
            return getattr(self, f"{name}_packed"), getattr(self, f"{name}_scale")
        joined = getattr(self, f"{name}_joined")
        return (joined if joined is not None else getattr(self, name)), None

    def expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.mxfp4:
            return tuple(self.stack(n)[0][e] for n in ("w1", "w2", "w3"))
        out = []
        for n in ("w1", "w2", "w3"):
            packed, scale = getattr(self, f"{n}_packed")[e], getattr(self, f"{n}_scale")[e]
            if self.mma_layout:
                packed = from_mma_layout(packed)
            out.append(dequantize_mxfp4(packed, scale, self.dtype, check_scales=False))
        return tuple(out)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, norm: RMSNorm | None = None,
                add: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Per token sum_k weights_k * expert_k(x) (fp32), then RMSNorm ``norm`` and / or ``+ add``,
        cast to ``out_dtype`` (None: fp32). The Triton path does the sum, norm, add and cast in one
        launch and rounds once; the reference rounds before the add, as the layer used to."""
        if triton_enabled("MOE", x.device):
            from ..ops.moe_triton import experts_triton

            return experts_triton(x, weights, ids, self, norm=norm, add=add, out_dtype=out_dtype)
        r = experts_ref(x, weights, ids, self.expert, *self.act)
        r = norm(r, out_dtype=out_dtype) if norm is not None else r.to(out_dtype) if out_dtype else r
        return r + add if add is not None else r


class MoE(nn.Module):
    """Router + routed experts (+ latent projections, K3) + shared experts.

    Latent MoE (routed_expert_hidden_size set): zeta = W_dn x; experts run at width dl;
    r = sum w_i y_i (fp32); optional RMSNorm on r; out = W_up r + shared(x). The router and the
    shared experts always read the full-width x.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        d, dl = cfg.hidden_size, cfg.routed_expert_hidden_size
        self.gate = Router(cfg, dtype, device)
        self.latent = dl is not None
        self.experts = RoutedExperts(cfg, dl if self.latent else d, dtype, device)
        if self.latent:
            self.routed_expert_down_proj = Linear(d, dl, dtype, device)
            self.routed_expert_up_proj = Linear(dl, d, dtype, device)
            self.routed_expert_norm = RMSNorm(dl, cfg.rms_norm_eps, dtype, device) if cfg.latent_moe_use_norm else None
        self.shared_experts = (
            GLUMLP(cfg, d, cfg.moe_intermediate_size * cfg.num_shared_experts, dtype, device)
            if cfg.num_shared_experts else None
        )

    def join_shared_experts(self) -> None:
        """For serving, before the linears fuse: the shared MLP joins the routed stacks where it
        can (``RoutedExperts.join_shared``). A shared MLP quantised into MXFP4 stacks is dropped:
        every batch then reads it from the stacks (``forward``)."""
        if self.shared_experts is not None and not self.latent:
            if self.experts.join_shared(self.shared_experts) and self.experts.mxfp4:
                self.shared_experts = None

    def add_norm_route(self, h: torch.Tensor, delta: torch.Tensor,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``layers.add_rms_norm(h, delta, norm)`` and the router's partial logits of its output
        in one launch, (h + delta, norm(h + delta), logit parts for ``forward``), where the Triton
        norm and router serve a few tokens (``moe_triton.add_norm_router_applies``); else None."""
        if not (norm_kernel_on(h) and self.gate.triton_routes(h)):
            return None
        from ..ops.moe_triton import add_norm_router_applies, add_norm_router_logits

        if not add_norm_router_applies(h, delta, self.gate.weight):
            return None
        return add_norm_router_logits(h, delta, norm.weight, norm.eps, self.gate.weight)

    def forward(self, x: torch.Tensor, logit_parts: torch.Tensor | None = None) -> torch.Tensor:
        """``logit_parts``: the router's partial logits of x, already computed (``add_norm_route``)."""
        if self.experts.num_shared and (self.shared_experts is None or (
                x.shape[0] <= SHARED_JOIN_MAX_TOKENS and not torch.is_grad_enabled()
                and triton_enabled("MOE", x.device))):  # the shared expert runs inside the grouped GEMMs
            weights, ids = self.gate(x, num_shared=self.experts.num_shared, logit_parts=logit_parts)
            return self.experts(x, weights, ids, out_dtype=x.dtype)
        weights, ids = self.gate(x, logit_parts=logit_parts)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        if not self.latent:  # the shared experts' output joins the routed sum before its one rounding
            return self.experts(x, weights, ids, add=shared, out_dtype=x.dtype)
        r = self.experts(self.routed_expert_down_proj(x), weights, ids, norm=self.routed_expert_norm, out_dtype=x.dtype)
        routed = self.routed_expert_up_proj(r)
        return routed + shared if shared is not None else routed

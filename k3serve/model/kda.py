"""Kimi Delta Attention token mixer (model-spec §2.3)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops.backend import triton_enabled
from ..ops.kda import kda_core
from ..ops.short_conv import short_conv_silu
from .batch import ForwardBatch, KDALayerCache
from .layers import Linear, LinearGroup, batched_linear, fuse_as_views, gated_rms_norm


# q and k L2-normalised by the short conv's kernel (fp32, one rounding; tiles one head wide) instead
# of by fla's l2norm launches inside chunk_kda (two a layer, each with its autotune lookup): at 8K
# tokens 0.330 ms for conv + norm against 0.416 + 0.074 (H200, RESULTS.md seventeenth session).
CONV_NORMS_QK = True


class KDAMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        d, H, D, W = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
        P = H * D
        self.num_heads, self.head_dim, self.lower_bound = H, D, cfg.kda_gate_lower_bound
        self.eps = cfg.rms_norm_eps
        lin = lambda i, o, tp=0: Linear(i, o, dtype, device, tp_dim=tp)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(d, P), lin(d, P), lin(d, P)
        f32 = dict(dtype=torch.float32, device=device)
        # Conv weights, gate parameters and the output-norm weight are always held in fp32.
        self.q_conv1d = nn.Parameter(torch.empty(P, W, **f32), requires_grad=False)
        self.k_conv1d = nn.Parameter(torch.empty(P, W, **f32), requires_grad=False)
        self.v_conv1d = nn.Parameter(torch.empty(P, W, **f32), requires_grad=False)
        self.f_a_proj = lin(d, D, None)
        self.f_b_proj = lin(D, P)
        self.dt_bias = nn.Parameter(torch.empty(P, **f32), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(H, **f32), requires_grad=False)
        self.b_proj = lin(d, H)
        self.full_rank_gate = cfg.kda_full_rank_gate
        if self.full_rank_gate:
            self.g_proj = lin(d, P)
        else:
            self.g_a_proj = lin(d, D, None)
            self.g_b_proj = lin(D, P)
        self.o_norm = nn.Parameter(torch.empty(D, **f32), requires_grad=False)
        self.o_proj = lin(P, d, 1)
        # Everything that reads the layer input x, as one GEMM once fused: [q|k|v, f_a, b, gate]
        # with a full-rank gate, [q|k|v, f_a|g_a, b] with a low-rank one (the two rank-D inputs
        # side by side, so both up-projections run as one batched GEMM).
        qkv = (self.q_proj, self.k_proj, self.v_proj)
        self.in_proj = (LinearGroup(qkv, self.f_a_proj, self.b_proj, self.g_proj) if self.full_rank_gate
                        else LinearGroup(qkv, (self.f_a_proj, self.g_a_proj), self.b_proj))
        self.register_buffer("conv_w", None, persistent=False)  # [3P, W] once fused
        self.register_buffer("fg_b", None, persistent=False)  # [2, P, D]: f_b and g_b stacked, once fused

    def fuse_conv_weights(self) -> None:
        """The q/k/v conv weights as one [3P, W] tensor (no concatenation per step); with a
        low-rank gate, f_b and g_b as one [2, P, D] stack (one batched GEMM instead of two)."""
        if self.conv_w is None:
            self.conv_w = fuse_as_views([self.q_conv1d, self.k_conv1d, self.v_conv1d])
        if self.fg_b is None and not self.full_rank_gate:
            self.fg_b = fuse_as_views([self.f_b_proj.weight, self.g_b_proj.weight]).view(2, *self.f_b_proj.weight.shape)

    def _decay_and_gate_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v, f, b, gate) from x: f the decay's pre-activation [T, P], gate [T, P]."""
        if self.full_rank_gate:
            qkv, f_a, b, gate = self.in_proj(x)
            return qkv, self.f_b_proj(f_a), b, gate
        qkv, fg_a, b = self.in_proj(x)
        D = self.head_dim
        if self.fg_b is None or torch.is_grad_enabled():
            return qkv, self.f_b_proj(fg_a[:, :D]), b, self.g_b_proj(fg_a[:, D:])
        fg_b = self.fg_b.to(fg_a.dtype)  # (static unless converted here)
        f, gate = batched_linear(fg_a.unflatten(1, (2, D)).transpose(0, 1), fg_b, static_weight=fg_b is self.fg_b)
        return qkv, f, b, gate

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: KDALayerCache) -> torch.Tensor:
        T = x.shape[0]
        H, D = self.num_heads, self.head_dim
        P = H * D
        qkv, f, b, gate = self._decay_and_gate_inputs(x)
        conv_w = self.conv_w if self.conv_w is not None else torch.cat([self.q_conv1d, self.k_conv1d, self.v_conv1d])
        if (batch.num_decodes == batch.num_seqs and not D & (D - 1)  # the kernel tiles need 2^n
                and triton_enabled("KDA", x.device)):  # the whole mixer step in one fused kernel
            from ..ops.kda_decode_triton import kda_decode_fused

            y = kda_decode_fused(qkv, conv_w, cache.conv, batch.has_context, f, b, self.A_log, self.dt_bias,
                                 gate, self.o_norm, self.eps, self.lower_bound, cache.recurrent, batch.kda_slots, H,
                                 out_dtype=x.dtype)
            return self.o_proj(y)
        norm = (2 * P, D) if CONV_NORMS_QK else None  # q and k L2-normalised in the conv, not in kda_core
        q, k, v = (t.view(T, H, D) for t in short_conv_silu(qkv, conv_w, cache.conv, batch, plane=P, norm=norm))
        # Gates and beta come from the layer input x, not from the conv output; the decay is
        # computed from f inside kda_core (fla's chunk kernel on CUDA).
        beta = torch.sigmoid(b.float())
        o = kda_core(q, k, v, f.view(T, H, D), beta, D ** -0.5, cache.recurrent, batch,
                     gate=(self.A_log, self.dt_bias, self.lower_bound), qk_normalized=norm is not None)
        return self.o_proj(gated_rms_norm(o, self.o_norm, gate, self.eps, x.dtype).view(T, P))

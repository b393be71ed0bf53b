"""Building blocks shared by every layer: norms, GLU activations, (tensor-parallel-ready) linears.

Parameters are created uninitialised (``torch.empty``) on the target device: the checkpoint
loader or the dummy initialiser fills them, so the model is never held twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.backend import triton_enabled


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype=None) -> torch.Tensor:
    """gamma * x / sqrt(mean(x^2) + eps) with statistics and the weight product in fp32."""
    if norm_kernel_on(x):
        from ..ops.norm_triton import rms_norm_triton  # one launch instead of ~6

        return rms_norm_triton(x, weight, eps, out_dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(out_dtype or x.dtype)


def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """KDA's output: rms_norm(x) * sigmoid(gate) in fp32, cast once; x [T, H, D], gate [T, H*D]."""
    if norm_kernel_on(x):
        from ..ops.norm_triton import rms_norm_triton  # one launch instead of ~9

        return rms_norm_triton(x, weight, eps, out_dtype, gate=gate)
    y = rms_norm(x, weight, eps, torch.float32) * torch.sigmoid(gate.float().reshape(x.shape))
    return y.to(out_dtype)


def norm_kernel_on(x: torch.Tensor) -> bool:
    """Whether the Triton norm kernels (also MLA's latent write) serve ``x``: no gradient
    being recorded, the NORM backend on for its device."""
    return not torch.is_grad_enabled() and triton_enabled("NORM", x.device)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, norm: "RMSNorm") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual update and the next norm: (h + delta, norm(h + delta)); one launch with the
    Triton norm backend instead of an add and a norm."""
    if norm_kernel_on(h) and h.dim() == 2 and delta.dtype == h.dtype:
        from ..ops.norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(h, delta, norm.weight, norm.eps)
    h = h + delta
    return h, norm(h)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype=None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, out_dtype)


def glu_activation(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 1.0,
                   linear_beta: float | None = None) -> torch.Tensor:
    """GLU in fp32, cast back to gate's dtype. silu: silu(a)*b. situ (SiTU-GLU, K3):
    [beta*tanh(a/beta) * sigmoid(a)] * [linear_beta*tanh(b/linear_beta)]; the sigmoid sees the
    unclipped a, and b is unclipped when linear_beta is None. sigmoid: sigmoid(a)*b (MLA's output gate)."""
    if not torch.is_grad_enabled() and triton_enabled("GLU", gate.device):
        from ..ops.glu_triton import glu_triton  # one launch instead of 5 (SiLU) to ~10 (SiTU)

        return glu_triton(gate, up, act, beta, linear_beta)
    a, b = gate.float(), up.float()
    if act == "silu":
        y = F.silu(a) * b
    elif act == "sigmoid":
        y = torch.sigmoid(a) * b
    elif act == "situ":
        y = beta * torch.tanh(a / beta) * torch.sigmoid(a)
        if linear_beta is not None:
            b = linear_beta * torch.tanh(b / linear_beta)
        y = y * b
    else:
        raise ValueError(f"unknown activation {act!r}")
    return y.to(gate.dtype)


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T in the weight's dtype: cuBLAS, or on the GPU our split-K GEMV for decode-sized
    batches (``ops.gemv_triton.linear`` decides). ``weight``: a module's weight (static: a GEMV
    program may read it before its PDL wait)."""
    if x.is_cuda:
        from ..ops.gemv_triton import linear

        return linear(x, weight, static_weight=True)
    return F.linear(x.to(weight.dtype), weight)


def batched_linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
                   static_weight: bool = False) -> torch.Tensor:
    """x [B, T, K] @ weight [B, N, K]^T -> [B, T, N] in the weight's dtype (x cast to it; fp32
    accumulation), or written into ``out`` (any dtype): on the GPU our batched GEMV for
    decode-sized batches (one launch, PDL), torch.matmul elsewhere. ``static_weight``: no kernel
    of the step writes ``weight`` (``gemv``)."""
    if x.is_cuda:
        from ..ops.gemv_triton import batched_gemv_applies, gemv

        if batched_gemv_applies(x, weight):
            return gemv(x, weight, out=out, static_weight=static_weight)
    y = torch.matmul(x.to(weight.dtype), weight.transpose(1, 2))
    return y if out is None else out.copy_(y)


class Linear(nn.Module):
    """Bias-free linear, y = x W^T, W stored [out, in] as in the checkpoints.

    ``tp_dim`` says how the full checkpoint matrix is split across tensor-parallel ranks:
    0 = column parallel (split outputs), 1 = row parallel (split inputs), None = replicated.
    With tp_size 1 (the default) it is a plain linear; the row-parallel all-reduce belongs to
    the caller's process group and arrives with the distributed issue.
    """

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, device=None,
                 tp_dim: int | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        if tp_dim is not None and (in_features, out_features)[1 - tp_dim] % tp_size:
            raise ValueError(f"{out_features if tp_dim == 0 else in_features} is not divisible by tp_size={tp_size}")
        self.full_shape = (out_features, in_features)
        self.tp_dim, self.tp_rank, self.tp_size = tp_dim, tp_rank, tp_size
        shape = list(self.full_shape)
        if tp_dim is not None:
            shape[tp_dim] //= tp_size
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full checkpoint matrix."""
        if self.tp_dim is None or self.tp_size == 1:
            return full
        return full.chunk(self.tp_size, dim=self.tp_dim)[self.tp_rank]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight)


def fuse_as_views(params: list[nn.Parameter]) -> torch.Tensor:
    """One tensor holding ``params`` concatenated along dim 0; each parameter is re-homed as a view
    of it, so the weights are not held twice and later in-place loads still reach the fused copy."""
    fused = torch.cat([p.detach() for p in params])
    offset = 0
    for p in params:
        n = p.shape[0]
        p.data = fused[offset: offset + n]
        offset += n
    return fused


class LinearGroup(nn.Module):
    """Linears that read the same input, run as one GEMM once fused (one kernel and one read of x
    instead of one per member; vLLM's merged QKV / gate-up projections, built after loading).

    ``LinearGroup((q, k, v), f, b)`` returns [q|k|v, f, b]: a tuple of members gives one output,
    their columns side by side. Until ``fuse()`` the members run one by one, so checkpoint loading,
    dummy init and training see ordinary separate parameters (with gradients on they still do).
    Only column-parallel or replicated members can join (each rank multiplies the full x by its
    own output rows).
    """

    def __init__(self, *outputs: Linear | tuple[Linear, ...]):
        super().__init__()
        self._outputs = [o if isinstance(o, tuple) else (o,) for o in outputs]  # registered on their owner
        members = [m for o in self._outputs for m in o]
        if any(m.tp_dim == 1 for m in members):
            raise ValueError("a row-parallel linear reads a sharded input and cannot join a group")
        self.sizes = [sum(m.weight.shape[0] for m in o) for o in self._outputs]
        self.register_buffer("fused", None, persistent=False)

    def fuse(self) -> None:
        """Members already re-homed into another fused tensor (a shared MLP joined to its layer's
        expert stacks) stay there: the group keeps running them one by one."""
        members = [m.weight for o in self._outputs for m in o]
        if self.fused is None and not any(_is_slice_of_larger(w) for w in members):
            self.fused = fuse_as_views(members)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.fused is None or torch.is_grad_enabled():
            return [torch.cat([m(x) for m in o], dim=-1) if len(o) > 1 else o[0](x) for o in self._outputs]
        return list(dense_linear(x, self.fused).split(self.sizes, dim=-1))


def _is_slice_of_larger(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() > t.numel() * t.element_size()

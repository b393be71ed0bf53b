"""KDA's short causal depthwise convolution over a varlen batch, with per-slot conv state.

The conv state of a sequence is its last W-1 *pre-conv* inputs, [C, W-1], oldest first; a
sequence with no cached context starts from zeros (its slot is never read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model.batch import ForwardBatch
from .backend import triton_enabled
from .kda_ref import l2norm


def short_conv_silu(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch,
                    plane: int | None = None, norm: tuple[int, int] | None = None) -> torch.Tensor:
    """SiLU(short conv) in x's dtype as planes [C/P, T, P] (``plane`` P; None: C): q, k and v of a
    KDA layer come out as separate [T, P] planes. The Triton kernel (KDA backend on CUDA) stores
    them contiguous and rounds once; the reference rounds the conv output, then the SiLU.
    ``norm`` = (N, D): the first N channels also L2-normalised per head of D (``kda_ref.l2norm``,
    KDA's q and k), in the kernel before its one rounding."""
    T, C = x.shape
    plane = plane or C
    if triton_enabled("KDA", x.device):
        from .short_conv_triton import short_conv_triton

        return short_conv_triton(x, weight, conv_state, batch, silu=True, plane=plane, norm=norm)
    y = F.silu(short_conv_ref(x, weight, conv_state, batch).float())
    if norm is not None:
        y = l2norm_heads(y, *norm)
    return y.to(x.dtype).view(T, C // plane, plane).transpose(0, 1)


def l2norm_heads(y: torch.Tensor, channels: int, head_dim: int) -> torch.Tensor:
    """y [T, C] fp32 with its first ``channels`` L2-normalised per head of ``head_dim``
    (``kda_ref.l2norm``): what ``short_conv_silu``'s ``norm`` does to q and k."""
    return torch.cat([l2norm(y[:, :channels].unflatten(1, (-1, head_dim))).flatten(1), y[:, channels:]], 1)


def short_conv_ref(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   batch: ForwardBatch) -> torch.Tensor:
    """x [T, C] pre-conv inputs; weight [C, W] fp32; conv_state [num_slots, C, W-1] (updated in
    place at each sequence's slot). Returns the conv output [T, C] (fp32 math, x's dtype), no
    activation."""
    T, C = x.shape
    W = weight.shape[-1]
    out = torch.empty_like(x)
    has_ctx = (batch.context_lens > 0).view(-1, 1, 1)
    nd = batch.num_decodes
    wf = weight.float()
    if nd:
        slots = batch.kda_slots[:nd]
        prev = torch.where(has_ctx[:nd], conv_state[slots].float(), 0.0)
        window = torch.cat([prev, x[:nd].float().unsqueeze(-1)], dim=-1)  # [nd, C, W]
        out[:nd] = (window * wf).sum(-1).to(x.dtype)
        conv_state[slots] = window[..., 1:].to(conv_state.dtype)
    for i in range(nd, batch.num_seqs):
        s, e = batch.token_range(i)
        slot = batch.kda_slots[i]
        prev = conv_state[slot].float() if batch.context_lens_host[i] > 0 else x.new_zeros(C, W - 1, dtype=torch.float32)
        seq = torch.cat([prev, x[s:e].float().t()], dim=-1)  # [C, W-1+L]
        y = F.conv1d(seq.unsqueeze(0), wf.unsqueeze(1), groups=C)[0]  # [C, L]
        out[s:e] = y.t().to(x.dtype)
        conv_state[slot] = seq[:, -(W - 1):].to(conv_state.dtype)
    return out

"""Block AttnRes mixer in one Triton pass per token: scores of every source (w . RMSNorm(v_i)),
softmax over the sources, the weighted sum of the un-normalised sources, and the following
RMSNorm (model-spec §2.7). Sources are read once; nothing intermediate goes to memory.

Reference: ``model.attn_res.AttnResMixer`` + ``model.layers.rms_norm``. Checked on CPU with
``TRITON_INTERPRET=1`` (tests/test_attn_res_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_start


@triton.jit
def _attn_res_kernel(SRC, QW, OUTW, OUT, DELTA, stride_src_m, stride_src_t, stride_out_t, stride_delta_t, M, D, eps,
                     HAS_OUT_NORM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     HAS_DELTA: tl.constexpr = False, RESET: tl.constexpr = False, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    dm = tl.arange(0, BLOCK_D)
    mm = tl.arange(0, BLOCK_M)
    dmask = dm < D
    mmask = mm < M
    v = tl.load(SRC + mm[:, None] * stride_src_m + t * stride_src_t + dm[None, :],
                mask=mmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # [M, D]
    if HAS_DELTA:  # the last source (the partial) takes its pending update, rounded as stored, first
        last = SRC + (M - 1) * stride_src_m + t * stride_src_t + dm
        new = tl.load(DELTA + t * stride_delta_t + dm, mask=dmask, other=0.0).to(tl.float32)
        if not RESET:
            new += tl.load(last, mask=dmask, other=0.0).to(tl.float32)
        new = new.to(SRC.dtype.element_ty)
        tl.store(last, new, mask=dmask)
        v = tl.where((mm == M - 1)[:, None], new.to(tl.float32)[None, :], v)
    qw = tl.load(QW + dm, mask=dmask, other=0.0).to(tl.float32)  # pseudo-query, key-norm weight folded in
    ms = tl.sum(v * v, 1) / D
    score = tl.sum(v * qw[None, :], 1) / tl.sqrt(ms + eps)
    score = tl.where(mmask, score, float("-inf"))
    p = tl.exp(score - tl.max(score, 0))
    p = p / tl.sum(p, 0)
    mix = tl.sum(p[:, None] * v, 0)  # [D]
    if HAS_OUT_NORM:
        mix = mix / tl.sqrt(tl.sum(mix * mix, 0) / D + eps) * tl.load(OUTW + dm, mask=dmask, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out_t + dm, mix.to(OUT.dtype.element_ty), mask=dmask)


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, eps: float, out_norm: torch.Tensor | None = None,
                 out_dtype=torch.float32, partial_update: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
    """sources [M, T, d] (M <= 16); query [d]: the pseudo-query times the key-norm weight
    (``AttnResMixer.folded_query``); out_norm [d]: the RMSNorm weight applied to the mix (None for
    the final mixer). Returns [T, d] in ``out_dtype``, written by the kernel (no cast pass).
    ``partial_update`` (delta [T, d], reset): first sources[-1] += delta (reset: = delta), in
    place and rounded to the sources' dtype, as ``AttnResState`` would have done before the call."""
    M, T, D = sources.shape
    if sources.stride(2) != 1:
        if partial_update is not None:
            raise ValueError("a partial update is written in place: the sources need a contiguous last dim")
        sources = sources.contiguous()
    delta, reset = partial_update if partial_update is not None else (sources[0], False)
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    out = torch.empty(T, D, dtype=out_dtype, device=sources.device)
    _attn_res_kernel[(T,)](sources, query, out_norm if out_norm is not None else query, out, delta, sources.stride(0),
                           sources.stride(1), out.stride(0), delta.stride(0), M, D, eps,
                           HAS_OUT_NORM=out_norm is not None, BLOCK_D=triton.next_power_of_2(D),
                           BLOCK_M=max(2, triton.next_power_of_2(M)), HAS_DELTA=partial_update is not None,
                           RESET=reset, **pdl.launch(out.device))
    return out

"""Block AttnRes mixer in one Triton launch (a program a token): scores of every source (w . RMSNorm(v_i)),
softmax over the sources, the weighted sum of the un-normalised sources, and the following
RMSNorm (model-spec §2.7). Sources stream from memory once (the mix re-reads each row from L1 /
L2, so no [sources, D] tile has to live in registers); nothing intermediate goes to memory.

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
    """One token: two passes over its sources, one source row in registers at a time (a [M, D] tile
    of K3's up to 16 sources x 7,168 spilled ~12 KB a thread on sm_90): the scores, then the mix of
    the rows read again (from L1 / L2)."""
    pdl_start(USE_PDL)
    t = tl.program_id(0)
    dm = tl.arange(0, BLOCK_D)
    mm = tl.arange(0, BLOCK_M)
    dmask = dm < D
    row0 = SRC + t * stride_src_t + dm
    new = tl.zeros([BLOCK_D], tl.float32)
    if HAS_DELTA:  # the last source (the partial) takes its pending update, rounded as stored, first
        last = row0 + (M - 1) * stride_src_m
        upd = tl.load(DELTA + t * stride_delta_t + dm, mask=dmask, other=0.0).to(tl.float32)
        if not RESET:
            upd += tl.load(last, mask=dmask, other=0.0).to(tl.float32)
        upd = upd.to(SRC.dtype.element_ty)
        tl.store(last, upd, mask=dmask)
        new = upd.to(tl.float32)
    qw = tl.load(QW + dm, mask=dmask, other=0.0).to(tl.float32)  # pseudo-query, key-norm weight folded in
    score = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for m in range(M):
        v = _source_row(row0, m, M, stride_src_m, dm, D, new, HAS_DELTA)
        s = tl.sum(v * qw, 0) / tl.sqrt(tl.sum(v * v, 0) / D + eps)
        score = tl.where(mm == m, s, score)
    p = tl.exp(score - tl.max(score, 0))
    p = p / tl.sum(p, 0)
    mix = tl.zeros([BLOCK_D], tl.float32)
    for m in range(M):
        mix += tl.sum(tl.where(mm == m, p, 0.0), 0) * _source_row(row0, m, M, stride_src_m, dm, D, new, HAS_DELTA)
    if HAS_OUT_NORM:
        mix = mix / tl.sqrt(tl.sum(mix * mix, 0) / D + eps) * tl.load(OUTW + dm, mask=dmask, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out_t + dm, mix.to(OUT.dtype.element_ty), mask=dmask)


@triton.jit
def _source_row(row0, m, M, stride_src_m, dm, D, new, HAS_DELTA: tl.constexpr):
    """Source m's row in fp32; with HAS_DELTA the last one is ``new`` (its memory, just rewritten by
    this program's threads in another order, is not read back)."""
    if HAS_DELTA:  # (one vector comparison for the mask: the interpreter refuses a scalar operand)
        v = tl.load(row0 + m * stride_src_m, mask=dm < tl.where(m == M - 1, 0, D), other=0.0).to(tl.float32)
        v = tl.where(m == M - 1, new, v)
    else:
        v = tl.load(row0 + m * stride_src_m, mask=dm < D, other=0.0).to(tl.float32)
    return v


# Warps of a token's program: about 16 of its D values a thread (a source row, the pseudo-query and
# the mix stay in registers; K3's 7,168: 16 warps).
def _warps(block_d: int) -> int:
    return max(4, min(16, block_d // 512))


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
                           RESET=reset, num_warps=_warps(triton.next_power_of_2(D)), **pdl.launch(out.device))
    return out

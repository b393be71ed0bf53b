"""RMSNorm in one Triton kernel (a row a program, or a tile of many short rows): the plain-torch form costs ~6 launches a
norm (cast, square, mean, rsqrt, two products, cast back), and a decode step has 2-4 norms a layer.

Reference: ``model.layers.rms_norm`` (same contract). Checked on CPU with ``TRITON_INTERPRET=1``
(tests/test_norm_triton.py). On CUDA with the Triton backend for NORM (ops/backend.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_start


@triton.jit
def _rms_norm_kernel(X, W, GATE, Y, n_rows, stride_x, stride_y, stride_g, heads, D, eps, HAS_WEIGHT: tl.constexpr,
                     HAS_GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (row < n_rows)[:, None] & (cols < D)[None, :]
    x = tl.load(X + row[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x / rms_rows(x, D, eps)
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if HAS_GATE:  # row = token * heads + head; the gate row of a token holds every head's D values
        g = tl.load(GATE + ((row // heads) * stride_g + (row % heads) * D)[:, None] + cols[None, :], mask=mask, other=0.0)
        y = y * tl.sigmoid(g.to(tl.float32))
    tl.store(Y + row[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


# Rows a program where rows are many and short: one 128-wide row a program (KDA's gated output norm,
# T x H rows) left each thread one element, 0.29 ms a layer at 8K tokens on kimi-linear-48b (6x its
# bytes' copy time, RESULTS.md sixteenth session). A program takes NORM_TILE // width rows: 32 of
# 128 ran it at 84 / 91 % of copy (H = 32 / 96; 8 or 16 rows 82-88 %; one row 15 %).
NORM_TILE = 4096
NORM_MANY_ROWS = 1024  # below this many rows (decode), one row a program keeps every SM busy


def _rows_per_program(n_rows: int, block: int) -> int:
    return max(1, NORM_TILE // block) if n_rows >= NORM_MANY_ROWS else 1


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype=None,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """gamma * x / sqrt(mean(x^2) + eps) over the last dim, fp32 statistics; any leading shape,
    rows may be strided (the last dim must be dense). ``gate`` [T, H*D] for x [T, H, D]: the
    result times sigmoid(gate) (KDA's gated output norm; gate rows may be strided)."""
    D = x.shape[-1]
    rows = x.reshape(-1, D) if x.stride(-1) == 1 else x.contiguous().reshape(-1, D)
    out = torch.empty(rows.shape, dtype=out_dtype or x.dtype, device=x.device)
    heads = x.shape[-2] if gate is not None else 1
    if gate is not None and (x.dim() != 3 or gate.shape != (x.shape[0], heads * D) or gate.stride(-1) != 1):
        raise ValueError(f"gate {tuple(gate.shape)} must be [T, H*D] with dense rows for x {tuple(x.shape)}")
    n = rows.shape[0]
    if n:
        w = weight if weight is not None else rows  # unused without a weight
        g = gate if gate is not None else rows
        block = triton.next_power_of_2(D)
        per = _rows_per_program(n, block)
        _rms_norm_kernel[(triton.cdiv(n, per),)](rows, w, g, out, n, rows.stride(0), out.stride(0), g.stride(0), heads,
                                                 D, eps, HAS_WEIGHT=weight is not None, HAS_GATE=gate is not None,
                                                 ROWS=per, BLOCK=block, **pdl.launch(out.device))
    return out.view(x.shape)


@triton.jit
def residual_sum(H, DELTA, row, stride_h, stride_d, cols, mask, dtype: tl.constexpr):
    """h + delta at ``cols`` of ``row``, rounded to ``dtype`` as torch's add rounds the residual
    stream (shared by every kernel that adds it, so they agree bit for bit)."""
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    return (h + tl.load(DELTA + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)).to(dtype)


@triton.jit
def rms(x, D, eps):
    """sqrt(mean(x^2) + eps) of a whole fp32 row x (masked lanes 0) of D values."""
    return tl.sqrt(tl.sum(x * x, 0) / D + eps)


@triton.jit
def rms_rows(x, D, eps):
    """sqrt(mean(x^2) + eps) of each row of fp32 rows x [R, BLOCK] (masked lanes 0), as [R, 1]."""
    return tl.sqrt(tl.sum(x * x, 1) / D + eps)[:, None]


@triton.jit
def _add_rms_norm_kernel(H, DELTA, W, H_OUT, Y, n_rows, stride_h, stride_d, stride_ho, stride_y, D, eps,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    row = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (row < n_rows) & (cols < D)
    s = residual_sum(H, DELTA, row, stride_h, stride_d, cols, mask, H_OUT.dtype.element_ty)
    tl.store(H_OUT + row * stride_ho + cols, s, mask=mask)
    x = s.to(tl.float32)
    y = x / rms_rows(x, D, eps) * tl.load(W + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# Warps of the add + RMSNorm's program a row (its sum of squares crosses warps through shared memory):
# 8 against Triton's default 4, kimi-linear's 53 a step 112 -> 93 us at batch 1 and 16 (1 and 2
# warps: 177 and 155; RESULTS.md twenty-third session). Many short rows take ``_rows_per_program``'s
# tiles on Triton's default 4 warps, as ``rms_norm_triton`` (a 128-wide row a program on 8 warps:
# 19 % of copy at 262,144 rows, 0.26x torch, RESULTS.md forty-third session).
ADD_NORM_WARPS = 8


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight) for [T, D] rows, both in h's dtype, one launch."""
    T, D = h.shape
    h, delta = (t if t.stride(-1) == 1 else t.contiguous() for t in (h, delta))
    h_out, y = torch.empty_like(h), torch.empty_like(h)
    if T:
        block = triton.next_power_of_2(D)
        per = _rows_per_program(T, block)
        _add_rms_norm_kernel[(triton.cdiv(T, per),)](h, delta, weight, h_out, y, T, h.stride(0), delta.stride(0),
                                                     h_out.stride(0), y.stride(0), D, eps, ROWS=per, BLOCK=block,
                                                     num_warps=ADD_NORM_WARPS if per == 1 else 4,
                                                     **pdl.launch(y.device))
    return h_out, y


@triton.jit
def _latent_to_cache_kernel(KV, W, CACHE, PAGE, OFFSET, stride_kv, stride_cp, stride_ct, R, DR, eps,
                            R_P: tl.constexpr, DR_P: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    r, p = tl.arange(0, R_P), tl.arange(0, DR_P)
    c = tl.load(KV + t * stride_kv + r, mask=r < R, other=0.0).to(tl.float32)
    y = c / tl.sqrt(tl.sum(c * c, 0) / R + eps) * tl.load(W + r, mask=r < R, other=0.0).to(tl.float32)
    row = CACHE + tl.load(PAGE + t) * stride_cp + tl.load(OFFSET + t) * stride_ct
    # rounded to the projection's dtype first, as the norm's output would be, then to the cache's
    tl.store(row + r, y.to(KV.dtype.element_ty).to(CACHE.dtype.element_ty), mask=r < R)
    pe = tl.load(KV + t * stride_kv + R + p, mask=p < DR, other=0.0)
    tl.store(row + R + p, pe.to(CACHE.dtype.element_ty), mask=p < DR)


def latent_to_cache(kv: torch.Tensor, weight: torch.Tensor, eps: float, cache: torch.Tensor, page: torch.Tensor,
                    offset: torch.Tensor) -> None:
    """MLA's new cache rows in one launch: kv [T, R + DR] = [c ; k_pe] (rows may be strided), the
    latent c RMSNorm-ed with ``weight`` [R], k_pe as is, written to cache[page[t], offset[t]]
    ([pages, page_size, R + DR], rows dense). Replaces the norm, the concatenation and the
    indexed store (three launches a layer)."""
    T, width = kv.shape
    R = weight.shape[0]
    if kv.stride(1) != 1 or cache.stride(2) != 1 or cache.shape[2] != width:
        raise ValueError(f"kv {tuple(kv.shape)} and cache {tuple(cache.shape)} need dense rows of one width")
    if T:
        _latent_to_cache_kernel[(T,)](kv, weight, cache, page, offset, kv.stride(0), cache.stride(0), cache.stride(1),
                                      R, width - R, eps, R_P=triton.next_power_of_2(R),
                                      DR_P=triton.next_power_of_2(max(width - R, 1)), **pdl.launch(kv.device))


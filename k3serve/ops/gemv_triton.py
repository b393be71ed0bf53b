"""Dense linear layers at a few tokens (a decode step's projections): y = x W^T as a split-K GEMV.

At batch 1 a kimi-linear step spends ~1/3 of its time in cuBLAS GEMMs of one token: o_proj (19 MB
of weight) ran as a split-K GEMM plus a reduction kernel at 46 % of the copy ceiling, the KDA input
projection at ~80 % (bench/kernels_dense.py, RESULTS.md eighth session). Here the weight rows are
split over ~2 waves of programs along N and K; each program streams its [BLOCK_N, K/SPLIT_K] slab
through the tensor cores against the tokens (padded to 16), and the last program of each column
block to finish (ops/tickets.py) sums the split partials in a fixed order and writes the output:
one launch, deterministic, no zero-fill."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import pdl
from .autotune import autotuned, interpreted
from .backend import triton_enabled
from .norm_triton import add_to_residual, norm_rows_when_done
from .pdl import pdl_start
from .tickets import last_arrival, tickets


@triton.jit
def _gemv_kernel(X, W, OUT, PART, TICKETS, T, N, K, stride_x, stride_w, stride_o, RES, NORM_W, Y, eps,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 IEEE: tl.constexpr, RESIDUAL: tl.constexpr = False, NORM_BLOCK: tl.constexpr = 1,
                 USE_PDL: tl.constexpr = False):
    """Program (column block, K split): partial [BLOCK_N, tokens] over its K range in fp32.
    RESIDUAL: the product is a residual delta: OUT = RES + product, Y = RMSNorm(OUT) * NORM_W."""
    pdl_start(USE_PDL)
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    nmask, tmask = n < N, t < T
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(W + n.to(tl.int64)[:, None] * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                    other=0.0)
        x = tl.load(X + t[:, None] * stride_x + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(w, tl.trans(x.to(w.dtype)), out_dtype=tl.float32)
    out_mask = tmask[None, :] & nmask[:, None]
    if SPLIT_K == 1:
        _gemv_store(acc, OUT, RES, NORM_W, Y, TICKETS, t, n, out_mask, T, N, stride_o, eps, RESIDUAL, NORM_BLOCK)
    else:
        part = PART + (split * BLOCK_T + t[None, :]) * N + n[:, None]
        tl.store(part, acc, mask=out_mask)
        if last_arrival(TICKETS, pid_n, SPLIT_K):
            total = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for s in range(SPLIT_K):  # a fixed order: the same sums whichever program came last
                total += tl.load(PART + (s * BLOCK_T + t[None, :]) * N + n[:, None], mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            _gemv_store(total, OUT, RES, NORM_W, Y, TICKETS, t, n, out_mask, T, N, stride_o, eps, RESIDUAL,
                        NORM_BLOCK)


@triton.jit
def _gemv_store(acc, OUT, RES, NORM_W, Y, TICKETS, t, n, out_mask, T, N, stride_o, eps, RESIDUAL: tl.constexpr,
                NORM_BLOCK: tl.constexpr):
    """A finished column block [BLOCK_N, tokens]: stored, or added to the residual stream, whose
    rows the last column block to finish then norms (the counter after the column blocks')."""
    if RESIDUAL:
        add_to_residual(acc, RES, OUT, t[None, :], n[:, None], out_mask, stride_o)
        norm_rows_when_done(TICKETS, tl.cdiv(N, 16), tl.num_programs(0), OUT, NORM_W, Y, T, N, eps, stride_o,
                            NORM_BLOCK)
    else:
        tl.store(OUT + t[None, :] * stride_o + n[:, None], acc.to(OUT.dtype.element_ty), mask=out_mask)


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages), picked per (N, K) on the GPU at first use.
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=st)
                for bn, bk, sk, w, st in ((32, 256, 4, 4, 3), (64, 256, 4, 4, 3), (64, 128, 8, 4, 4),
                                          (32, 512, 2, 4, 3), (128, 128, 2, 4, 4), (64, 256, 2, 4, 3),
                                          (128, 256, 1, 8, 3), (32, 256, 8, 4, 3))]
_gemv_tuned = autotuned(_gemv_kernel, GEMV_CONFIGS, triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}),
                        key=["N", "K", "IEEE"])
_MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in GEMV_CONFIGS)  # rows of the partials' buffer, / 16

# Tokens up to which a linear takes the GEMV (the tokens share one 16-wide MMA tile).
GEMV_MAX_TOKENS = 4
# Weights past this many elements stay with cuBLAS: on the H200 the GEMV won on the 29 M-element
# KDA input projection (82-84 % of copy vs 77-79 %) and lost on the 42 M dense gate+up (70-74 % vs
# 83 %); at the LM head both stream at the copy ceiling (RESULTS.md eighth session).
GEMV_MAX_WEIGHT = 32 << 20
# Up to this many tokens a GEMV whose product joins the residual stream also adds it and runs the
# next RMSNorm in its launch (``gemv(residual=...)``, ``model.layers.Linear``); 0 turns that off.
RESIDUAL_MAX_TOKENS = GEMV_MAX_TOKENS


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None,
         residual: tuple | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (T <= 16) @ weight [N, K]^T -> [T, N] in the weight's dtype; fp32 accumulation.
    ``config`` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages as keys) pins the tile (benches).
    ``residual`` (h [T, N], norm weight [N], eps): the product is the delta of the residual stream
    h; returns (h + delta, RMSNorm(h + delta) * weight), both in h's dtype, in the same launch."""
    T, K = x.shape
    N = weight.shape[0]
    if T > 16 or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv takes up to 16 tokens with dense rows, got x {tuple(x.shape)} {x.stride()}")
    ieee = weight.dtype == torch.float32 or interpreted()  # (the interpreter's bf16 dot is not exact)
    part = torch.empty(_MAX_SPLIT_K * 16, N, dtype=torch.float32, device=x.device)
    if residual is None:
        out = torch.empty(T, N, dtype=weight.dtype, device=x.device)
        res = norm_w = y = out
        eps, extra = 0.0, {}
    else:
        res, norm_w, eps = residual
        if res.shape != (T, N):
            raise ValueError(f"residual {tuple(res.shape)} does not match the product [{T}, {N}]")
        res = res.contiguous()
        out, y = torch.empty_like(res), torch.empty_like(res)
        extra = {"RESIDUAL": True, "NORM_BLOCK": triton.next_power_of_2(N)}
    args = (x, weight, out, part, tickets(x.device, triton.cdiv(N, 16) + 1), T, N, K, x.stride(0), weight.stride(0),
            out.stride(0), res, norm_w, y, float(eps))
    if config is None:
        _gemv_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            *args, BLOCK_T=16, IEEE=ieee, **extra, **pdl.launch(out.device))
    else:
        c = dict(config)
        meta = {k: c.pop(k) for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}
        _gemv_kernel[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            *args, BLOCK_T=16, IEEE=ieee, **meta, **c, **extra, **pdl.launch(out.device))
    return out if residual is None else (out, y)


def takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``linear`` runs x W^T as our GEMV: a few tokens on the GPU where the GEMV backend is
    on, the weight at most GEMV_MAX_WEIGHT elements, no gradient being recorded."""
    return (x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and weight.numel() <= GEMV_MAX_WEIGHT
            and not torch.is_grad_enabled()  # (no backward: training keeps cuBLAS)
            and triton_enabled("GEMV", x.device) and x.stride(-1) == 1 and weight.stride(-1) == 1)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (x cast to the weight's dtype), through ``gemv`` where ``takes_gemv``."""
    x = x.to(weight.dtype)
    return gemv(x, weight) if takes_gemv(x, weight) else F.linear(x, weight)

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
from .pdl import pdl_start
from .tickets import last_arrival, tickets


@triton.jit
def _gemv_kernel(X, W, OUT, PART, TICKETS, T, N, K, stride_x, stride_w, stride_o,
                 BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                 IEEE: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (column block, K split): partial [BLOCK_N, tokens] over its K range in fp32."""
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
        tl.store(OUT + t[None, :] * stride_o + n[:, None], acc.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        part = PART + (split * BLOCK_T + t[None, :]) * N + n[:, None]
        tl.store(part, acc, mask=out_mask)
        if last_arrival(TICKETS, pid_n, SPLIT_K):
            total = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for s in range(SPLIT_K):  # a fixed order: the same sums whichever program came last
                total += tl.load(PART + (s * BLOCK_T + t[None, :]) * N + n[:, None], mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(OUT + t[None, :] * stride_o + n[:, None], total.to(OUT.dtype.element_ty), mask=out_mask)


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


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """x [T, K] (T <= 16) @ weight [N, K]^T -> [T, N] in the weight's dtype; fp32 accumulation.
    ``config`` (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages as keys) pins the tile (benches)."""
    T, K = x.shape
    N = weight.shape[0]
    if T > 16 or weight.stride(-1) != 1 or x.stride(-1) != 1:
        raise ValueError(f"gemv takes up to 16 tokens with dense rows, got x {tuple(x.shape)} {x.stride()}")
    out = torch.empty(T, N, dtype=weight.dtype, device=x.device)
    ieee = weight.dtype == torch.float32 or interpreted()  # (the interpreter's bf16 dot is not exact)
    part = torch.empty(_MAX_SPLIT_K * 16, N, dtype=torch.float32, device=x.device)
    args = (x, weight, out, part, tickets(x.device, triton.cdiv(N, 16)), T, N, K, x.stride(0), weight.stride(0),
            out.stride(0))
    if config is None:
        _gemv_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            *args, BLOCK_T=16, IEEE=ieee, **pdl.launch(out.device))
    else:
        c = dict(config)
        meta = {k: c.pop(k) for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}
        _gemv_kernel[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"])](
            *args, BLOCK_T=16, IEEE=ieee, **meta, **c,
            **pdl.launch(out.device))
    return out


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) (x cast to the weight's dtype), through ``gemv`` for a few tokens on
    the GPU where the GEMV backend is on, the weight is at most GEMV_MAX_WEIGHT elements and no
    gradient is being recorded."""
    x = x.to(weight.dtype)
    if (x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and weight.numel() <= GEMV_MAX_WEIGHT
            and not torch.is_grad_enabled()  # (no backward: training keeps cuBLAS)
            and triton_enabled("GEMV", x.device) and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return gemv(x, weight)
    return F.linear(x, weight)

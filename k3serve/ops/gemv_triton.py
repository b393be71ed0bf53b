"""Dense linear layers at a few tokens (a decode step's projections): y = x W^T as a split-K GEMV.

At batch 1 a kimi-linear step spends ~1/3 of its time in cuBLAS GEMMs of one token: o_proj (19 MB
of weight) ran as a split-K GEMM plus a reduction kernel at 46 % of the copy ceiling, the KDA input
projection at ~80 % (bench/kernels_dense.py, RESULTS.md eighth session). Here the weight rows are
split over ~2 waves of programs along N and K; each program streams its [BLOCK_N, K/SPLIT_K] slab
through the tensor cores against the tokens (padded to 16), and the last program of each column
block to finish (ops/tickets.py) sums the split partials in a fixed order and writes the output:
one launch, deterministic, no zero-fill.

A program whose whole K range is one tile (the small-K GEMVs: the KDA gates' up-projections, MLA's
query absorption and W_UV) reads that tile before its PDL wait when the caller says the weight is
a model weight (``static_weight``): its DRAM round trip overlaps the previous kernel instead of
following it (ops/pdl.py says what may be read before the wait)."""

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
def _times_x(acc, w, X, t, k, tmask, kmask, stride_xt, IEEE: tl.constexpr):
    """acc + w [BLOCK_N, BLOCK_K] @ x[t, k]^T in fp32 (bf16 weights through the tensor cores)."""
    x = tl.load(X + t[:, None] * stride_xt + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
    if IEEE:
        acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    else:
        acc += tl.dot(w, tl.trans(x.to(w.dtype)), out_dtype=tl.float32)
    return acc


@triton.jit
def _gemv_kernel(X, W, OUT, PART, TICKETS, T, N, K, stride_xb, stride_xt, stride_wb, stride_wn, stride_wk,
                 stride_ob, stride_ot, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr = False,
                 W_STATIC: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    """Program (column block, K split, batch): partial [BLOCK_N, tokens] over its K range in fp32.
    W_STATIC: no kernel of the step writes W; PRELOAD (set from it, _preload_applies): the
    program's K range is one tile, read before the PDL wait."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    X += b.to(tl.int64) * stride_xb
    W += b.to(tl.int64) * stride_wb
    OUT += b.to(tl.int64) * stride_ob
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    nmask, tmask = n < N, t < T
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    w_rows = W + n.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
    if PRELOAD:
        k = k_start + tl.arange(0, BLOCK_K)
        kmask = k < K
        w = tl.load(w_rows[:, None] + k[None, :] * stride_wk, mask=nmask[:, None] & kmask[None, :], other=0.0)
        pdl_start(USE_PDL)
        acc = _times_x(acc, w, X, t, k, tmask, kmask, stride_xt, IEEE)
    else:
        pdl_start(USE_PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            w = tl.load(w_rows[:, None] + k[None, :] * stride_wk, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = _times_x(acc, w, X, t, k, tmask, kmask, stride_xt, IEEE)
    out_mask = tmask[None, :] & nmask[:, None]
    if SPLIT_K == 1:
        tl.store(OUT + t[None, :] * stride_ot + n[:, None], acc.to(OUT.dtype.element_ty), mask=out_mask)
    else:
        PART += b.to(tl.int64) * SPLIT_K * BLOCK_T * N
        part = PART + (split * BLOCK_T + t[None, :]) * N + n[:, None]
        tl.store(part, acc, mask=out_mask)
        if last_arrival(TICKETS, b * tl.num_programs(0) + pid_n, SPLIT_K):
            total = tl.zeros([BLOCK_N, BLOCK_T], tl.float32)
            for s in tl.static_range(SPLIT_K):  # a fixed order; unrolled, so the loads are in flight together
                total += tl.load(PART + (s * BLOCK_T + t[None, :]) * N + n[:, None], mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(OUT + t[None, :] * stride_ot + n[:, None], total.to(OUT.dtype.element_ty), mask=out_mask)


# (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages), picked per (N, K) on the GPU at first use. (64, 128, 1,
# 4, 1): the KDA gates' up-projection (K = 128, one tile a program) in the decode step's chain, where
# the autotuner's pick alone, (128, 256, 1, 8, 3), half of its K tile masked, took 4.9 against 4.3 us
# a layer (RESULTS.md twenty-fifth session).
GEMV_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w, num_stages=st)
                for bn, bk, sk, w, st in ((32, 256, 4, 4, 3), (64, 256, 4, 4, 3), (64, 128, 8, 4, 4),
                                          (32, 512, 2, 4, 3), (128, 128, 2, 4, 4), (64, 256, 2, 4, 3),
                                          (128, 256, 1, 8, 3), (32, 256, 8, 4, 3), (64, 128, 1, 4, 1))]


def _preload_applies(args: dict) -> bool:
    """A static weight whose programs each take their whole K range in one tile."""
    return args["W_STATIC"] and args["SPLIT_K"] * args["BLOCK_K"] >= args["K"]


# Weights read before the PDL wait where _preload_applies (False: never; A/B timing).
PRELOAD = True
_gemv_launch = triton.heuristics({"PRELOAD": lambda a: PRELOAD and _preload_applies(a)})(_gemv_kernel)
_gemv_tuned = autotuned(_gemv_launch, GEMV_CONFIGS, triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}),
                        key=["N", "K", "IEEE"])
_MAX_SPLIT_K = max(c.kwargs["SPLIT_K"] for c in GEMV_CONFIGS)  # rows of the partials' buffer, / 16

# Tokens up to which a linear takes the GEMV (the tokens share one 16-wide MMA tile).
GEMV_MAX_TOKENS = 4
# Weights past this many elements stay with cuBLAS: on the H200 the GEMV won on the 29 M-element
# KDA input projection (82-84 % of copy vs 77-79 %) and lost on the 42 M dense gate+up (70-74 % vs
# 83 %); at the LM head both stream at the copy ceiling (RESULTS.md eighth session).
GEMV_MAX_WEIGHT = 32 << 20


# Tiles pinned per (N, K) ahead of the autotuner's choice, (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages):
# the autotuner times a GEMV alone, cold, but in a decode step it runs inside a PDL chain; an A/B of
# the graph-replayed step (bench/gpu_check_graphs.py --ab) sets this to try tiles where they serve.
PINNED: dict[tuple[int, int], tuple[int, int, int, int, int]] = {}


# Batched GEMVs (``batched_linear``) in place of torch.bmm at a few tokens; for A/B timing.
BATCHED = True


def gemv(x: torch.Tensor, weight: torch.Tensor, config: dict | None = None,
         out: torch.Tensor | None = None, static_weight: bool = False) -> torch.Tensor:
    """x [T, K] (T <= 16) @ weight [N, K]^T -> [T, N], or batched: x [B, T, K] @ weight [B, N, K]^T
    -> [B, T, N] (any strides but a unit one along K for x; weights may also be N-contiguous).
    x is multiplied in the weight's dtype (fp32 accumulation): bf16 weights through the tensor
    cores, fp32 ones exactly. The output is written into ``out`` if given (any dtype, any strides
    with a unit one along N), else into a new tensor of the weight's dtype. ``config`` (BLOCK_N,
    BLOCK_K, SPLIT_K, num_warps, num_stages as keys) pins the tile (benches). ``static_weight``:
    no kernel of the step writes ``weight`` (a model weight, not converted in the step), so a
    program of one K tile may read it before the PDL wait."""
    flat = x.dim() == 2
    xb, wb = (x[None], weight[None]) if flat else (x, weight)
    B, T, K = xb.shape
    N = wb.shape[1]
    if (T > 16 or xb.stride(-1) != 1 or wb.dim() != 3 or wb.shape[0] != B or wb.shape[2] != K
            or 1 not in wb.stride()[1:]):
        raise ValueError(f"gemv takes up to 16 tokens with dense rows, got x {tuple(x.shape)} {x.stride()} "
                         f"and weight {tuple(weight.shape)} {weight.stride()}")
    if out is None:
        out = torch.empty(*x.shape[:-1], N, dtype=weight.dtype, device=x.device)
    ob = out[None] if out.dim() == 2 else out
    if tuple(ob.shape) != (B, T, N) or ob.stride(-1) != 1:
        raise ValueError(f"gemv output must be {(B, T, N)} with unit stride along N, got {tuple(out.shape)}")
    # (the interpreter's bf16 dot and casts are not exact: there x and the weight multiply in fp32)
    ieee = weight.dtype == torch.float32 or interpreted()
    part = torch.empty(B * _MAX_SPLIT_K * 16, N, dtype=torch.float32, device=x.device)
    args = (xb, wb, ob, part, tickets(x.device, B * triton.cdiv(N, 16)), T, N, K, xb.stride(0), xb.stride(1),
            wb.stride(0), wb.stride(1), wb.stride(2), ob.stride(0), ob.stride(1))
    consts = dict(BLOCK_T=16, IEEE=ieee, W_STATIC=static_weight, **pdl.launch(out.device))
    if config is None and (N, K) in PINNED:
        config = dict(zip(("BLOCK_N", "BLOCK_K", "SPLIT_K", "num_warps", "num_stages"), PINNED[N, K]))
    if config is None:
        _gemv_tuned[lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], B)](*args, **consts)
    else:
        c = dict(config)
        meta = {k: c.pop(k) for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}
        _gemv_launch[(triton.cdiv(N, meta["BLOCK_N"]), meta["SPLIT_K"], B)](*args, **meta, **c, **consts)
    return out


def batched_gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gemv`` takes x [B, T, K] @ weight [B, N, K]^T (``layers.batched_linear``): a few
    tokens on the GPU where the GEMV backend is on, no gradient being recorded. (At the model's
    per-gate / per-head shapes it is as fast as torch.bmm, 3-4 us, latency-bound; it keeps the
    PDL chain and reads W_UV in bf16, so MLA keeps no fp32 copy of kv_b_proj: RESULTS.md tenth
    session.)"""
    return (x.shape[1] <= GEMV_MAX_TOKENS and BATCHED and not torch.is_grad_enabled()
            and triton_enabled("GEMV", x.device) and x.stride(-1) == 1 and 1 in weight.stride()[1:])


def linear(x: torch.Tensor, weight: torch.Tensor, static_weight: bool = False) -> torch.Tensor:
    """F.linear(x, weight) (x cast to the weight's dtype), through ``gemv`` for a few tokens on
    the GPU where the GEMV backend is on, the weight is at most GEMV_MAX_WEIGHT elements and no
    gradient is being recorded (``static_weight`` as there)."""
    x = x.to(weight.dtype)
    if (x.dim() == 2 and x.shape[0] <= GEMV_MAX_TOKENS and weight.numel() <= GEMV_MAX_WEIGHT
            and not torch.is_grad_enabled()  # (no backward: training keeps cuBLAS)
            and triton_enabled("GEMV", x.device) and x.stride(-1) == 1 and weight.stride(-1) == 1):
        return gemv(x, weight, static_weight=static_weight)
    return F.linear(x, weight)

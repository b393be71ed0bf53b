"""Block AttnRes mixer in one Triton launch (a program a token): scores of every source (w . RMSNorm(v_i)),
softmax over the sources, the weighted sum of the un-normalised sources, and the following
RMSNorm (model-spec §2.7). Nothing intermediate goes to memory.

A token's sources are read as [blocks, CHUNK] tiles, every block's piece of a chunk in one load
(a decode step has one program per token, so its time is load latency: the former loop over
sources, one row in registers at a time, waited on memory once per source and pass, 17.7 us at
K3's 9 sources, now 9.8). The last source, the running partial (the one a pending update may
still be owed to), is a vector of its own, so K3's 9 sources tile as 8 + 1. Two passes over the
chunks: the scores, then the mix (the sources re-read from L1 / L2 but for the last chunk, still in
registers), the whole mixed row kept in registers until its RMSNorm is known and it is stored.

A program a token waits on one memory round trip a chunk and pass; from 6 sources (2 chunks at
K3's width) a decode step's few tokens instead split each row between programs, one an SM, that
meet at a barrier (``_attn_res_split_kernel``): one read of the sources whatever their count (9
sources x 1 token 9.8 -> 7.9 us), the barrier's cost on top (2 sources: 5.1 against 7.3 us).

All mixers of a block read the same stored blocks, so at a block's first mixer the split kernel can
mix them once for every mixer of the block (``attn_res_summary``: a row and a logit a query); the
block's later mixers then read that row and the partial, 3 rows whatever the depth
(``model.attn_res.AttnResState.mix`` decides: SUMMARY_MIN_BLOCKS, a few tokens).

Reference: ``model.attn_res.AttnResMixer`` + ``model.layers.rms_norm``. Checked on CPU with
``TRITON_INTERPRET=1`` (tests/test_attn_res_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .autotune import interpreted, sm_count
from .pdl import pdl_start
from .tickets import barrier, tickets

# Elements of a [blocks, CHUNK] tile. Up to FEW_TOKENS tokens a program is alone on its SM: fewer,
# longer chunks (2 / 5 / 9 sources at K3's width 5.1 / 5.9 / 10.3 us against 6.1 / 8.5 / 12.0 with
# the smaller tile); more tokens share an SM: fewer registers each (9 sources x 4,096 tokens 243 us
# against 283). (bench/RESULTS.md, twenty-seventh session.)
TILE = 16384
TILE_FEW_TOKENS = 32768
FEW_TOKENS = 128
COLS_PER_THREAD = 8  # a 16-byte load of bf16: every warp on the columns (a chunk is 256 columns a warp)
MAX_CHUNK = 8192  # (16 warps, two 16-byte loads a row)
# Pass 2 takes the last chunk from pass 1's registers, up to FEW_TOKENS tokens and KEEP_LAST_ROWS
# blocks (16 spill): 9 sources x 1 / 16 / 64 tokens 9.8 / 10.3 / 11.7 us against 11.4 / 11.8 / 12.8;
# at 256 / 4,096 tokens the registers cost occupancy (26.8 / 335 against 21.8 / 249).
KEEP_LAST = True
KEEP_LAST_ROWS = 8
# Up to SPLIT_TOKENS tokens and from SPLIT_MIN_SOURCES sources, a token's row is split between
# programs (``_attn_res_split_kernel``), as many as fit the SMs one each, of at least SPLIT_MIN_COLS
# and at most SPLIT_MAX_COLS columns; more tokens, fewer sources (or a row that would not split) take
# a program each. SPLIT_TOKENS 0: never split (A/B timing).
SPLIT_TOKENS = 4
SPLIT_MIN_SOURCES = 6
SPLIT_MIN_COLS = 256
SPLIT_MAX_COLS = 2048
SPLIT_ROWS = 16  # the split kernel's source rows (the Gram's side, the tensor cores' least): at most 16 sources
SUMMARY_ROWS = 32  # a block summary's query rows: at most 32 mixers a block (K3: 24; 16 rows spilled, Triton 3.6)
# The split kernel's barrier is ``tickets.barrier``: int64 counts that only grow, one a (program count, token),
# so no atomic runs after the wait (the count-and-leave form's last round trip ended each program later:
# 72.0 -> 67.4 us of mixers on a k3-slice step's critical path at layers 84-87, thirtieth session).
BARRIER_SLOTS = 64  # growing counters a program count (a token each: SPLIT_TOKENS at most)


@triton.jit
def _attn_res_kernel(SRC, QW, OUTW, OUT, DELTA, stride_src_m, stride_src_t, stride_out_t, stride_delta_t, M, D, eps,
                     HAS_OUT_NORM: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, N_CHUNKS: tl.constexpr,
                     CHUNK_ROWS: tl.constexpr, KEEP_LAST: tl.constexpr, HAS_DELTA: tl.constexpr = False,
                     RESET: tl.constexpr = False, USE_PDL: tl.constexpr = False, TRACE=None, SUM=None, LOGIT=None,
                     stride_sum_t=0, SUMMARY: tl.constexpr = False):
    """One token: sources 0 .. M-2 as [BLOCK_M, CHUNK] tiles, source M-1 (the partial; with
    HAS_DELTA first updated by DELTA, rounded as stored) as a [CHUNK] vector. SUMMARY (M 3, the
    partial at SRC, stride_src_m 0): the blocks as one row of SUM (its high and low parts in the
    sources' dtype: the tile's two rows), their softmax already taken, with the log of their total
    weight LOGIT (``_attn_res_split_kernel``'s summary). A one-chunk row
    reads its static weights (the query, the norm weight: ops/pdl.py) before the PDL wait (the norm
    weight's cold read came last otherwise); the dots and squares are summed in two cross-warp
    reductions, not four (each a shared-memory barrier round). Both: a k3-slice step's mixers
    47.3 -> 35.4 us on its critical path at batch 1 (thirtieth session). TRACE
    (bench/attn_res_trace.py --token): the global timer past the wait, at the scores, at the mix
    (the partial stored), at the end."""
    t = tl.program_id(0)
    mm = tl.arange(0, BLOCK_M)
    cc = tl.arange(0, CHUNK)
    kk = tl.arange(0, CHUNK_ROWS)
    if N_CHUNKS == 1:
        qw_early = tl.load(QW + cc, mask=cc < D, other=0.0).to(tl.float32)
        if HAS_OUT_NORM:
            out_w = tl.load(OUTW + kk[:, None] * CHUNK + cc[None, :], mask=(kk[:, None] * CHUNK + cc[None, :]) < D,
                            other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    _trace(TRACE, t * 4)
    src = SRC + t * stride_src_t
    if SUMMARY:
        rows = SUM + t * stride_sum_t
    else:
        rows = None
    dot = tl.zeros([BLOCK_M], tl.float32)
    sq = tl.zeros([BLOCK_M], tl.float32)
    dot_last = 0.0
    sq_last = 0.0
    v = tl.zeros([BLOCK_M, CHUNK], tl.float32)
    last = tl.zeros([CHUNK], tl.float32)
    for i in range(N_CHUNKS):
        cols = i * CHUNK + cc
        v, last, _ = _chunk(src, DELTA + t * stride_delta_t, stride_src_m, mm, cols, M, D, HAS_DELTA, RESET, rows)
        if N_CHUNKS == 1:
            qw = qw_early
        else:
            qw = tl.load(QW + cols, mask=cols < D, other=0.0).to(tl.float32)  # pseudo-query, key-norm weight folded in
        if not SUMMARY:
            d, s = tl.reduce((v * qw[None, :], v * v), 1, _add_pairs)
            dot += d
            sq += s
        d_last, s_last = tl.reduce((last * qw, last * last), 0, _add_pairs)
        dot_last += d_last
        sq_last += s_last
    if SUMMARY:  # (the low row takes the high row's weight below)
        score = tl.where(mm == 0, tl.load(LOGIT + t), float("-inf"))
    else:
        score = tl.where(mm < M - 1, dot / tl.sqrt(sq / D + eps), float("-inf"))
    score_last = dot_last / tl.sqrt(sq_last / D + eps)
    top = tl.maximum(tl.max(score, 0), score_last)
    p = tl.exp(score - top)
    p_last = tl.exp(score_last - top)
    total = tl.sum(p, 0) + p_last
    p = p / total
    p_last = p_last / total
    if SUMMARY:
        p = tl.where(mm < 2, tl.sum(p, 0), 0.0)
    _trace(TRACE, t * 4 + 1)
    # the whole mixed row, chunk i in row i; with KEEP_LAST the last chunk from the registers pass 1
    # left it in (no second read; K3's up to 5 sources are one chunk), the others read again
    mix = tl.zeros([CHUNK_ROWS, CHUNK], tl.float32)
    if KEEP_LAST:
        piece = tl.sum(p[:, None] * v, 0) + p_last * last
        mix = tl.where(kk[:, None] == N_CHUNKS - 1, piece[None, :], mix)
        if HAS_DELTA:  # (the old partial's chunk was read by these threads, in this layout, in pass 1)
            cols = (N_CHUNKS - 1) * CHUNK + cc
            tl.store(src + (M - 1) * stride_src_m + cols, last.to(SRC.dtype.element_ty), mask=cols < D)
    for i in range(N_CHUNKS - KEEP_LAST):
        cols = i * CHUNK + cc
        v, last, last_ptr = _chunk(src, DELTA + t * stride_delta_t, stride_src_m, mm, cols, M, D, HAS_DELTA, RESET,
                                   rows)
        piece = tl.sum(p[:, None] * v, 0) + p_last * last
        mix = tl.where(kk[:, None] == i, piece[None, :], mix)
        if HAS_DELTA:  # after this chunk's last read of the old partial, by the same threads (same layout)
            tl.store(last_ptr, last.to(SRC.dtype.element_ty), mask=cols < D)
    cols = kk[:, None] * CHUNK + cc[None, :]
    _trace(TRACE, t * 4 + 2)
    if HAS_OUT_NORM:
        mix = mix / tl.sqrt(tl.sum(tl.sum(mix * mix, 1), 0) / D + eps)
        if N_CHUNKS != 1:
            out_w = tl.load(OUTW + cols, mask=cols < D, other=0.0).to(tl.float32)
        mix = mix * out_w
    tl.store(OUT + t * stride_out_t + cols, mix.to(OUT.dtype.element_ty), mask=cols < D)
    _trace(TRACE, t * 4 + 3)


@triton.jit
def _add_pairs(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _attn_res_split_kernel(SRC, QW, OUTW, OUT, DELTA, PART, TICKETS, group0, stride_src_m, stride_src_t, stride_out_t,
                           stride_delta_t, M, D, eps, HAS_OUT_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
                           COLS: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr, IEEE: tl.constexpr,
                           HAS_DELTA: tl.constexpr = False, RESET: tl.constexpr = False,
                           USE_PDL: tl.constexpr = False, TRACE=None, SUM=None, LOGIT=None, Q=1, stride_q=0,
                           stride_sum_q=0, stride_sum_t=0, BLOCK_Q: tl.constexpr = 1, SUMMARY: tl.constexpr = False):
    """Program (column block, token): its COLS columns of all M sources in registers; their dots
    with the query and their Gram matrix (bf16 products exact, fp32 sums) to PART; a barrier among
    the token's SPLIT programs; then each sums the parts in a fixed order (so all agree): the
    scores (the Gram's diagonal holds the sources' squares), the softmax, and the mix's sum of
    squares p' G p, which is what the norm needs: the row's total without a second barrier. Its
    own columns mixed and stored. PHASE 0: all of it; 1 / 2: before / after the barrier, as two
    launches (Triton's interpreter runs programs one by one: a barrier would never open). TRACE
    (bench/attn_res_trace.py): the global timer at the start, the arrival, past the barrier, the end.
    The query and the norm weight (static: ops/pdl.py) are read before the PDL wait. The token's
    barrier is ``tickets.barrier`` on the int64 count TICKETS[group0 + t].

    SUMMARY (the sources all stored blocks, at a block's first mixer): QW holds the Q queries of the
    block's mixers, [Q, D] (the first this mixer's); each query's dots with the sources come out of
    the parts as a [BLOCK_Q, BLOCK_M] product, and each program also writes, for every query j, its
    columns of SUM[j] = the blocks mixed by j's softmax ([2, D]: its high and low parts in the
    sources' dtype, so that j's mixer reads them in the sources' layout) and (program 0) LOGIT[j] = the log of
    that softmax's total, so that j's own mixer needs the partial alone beside them
    (``_attn_res_kernel``'s SUMMARY): the block's later mixers read that row, not all the blocks."""
    s = tl.program_id(0)
    t = tl.program_id(1)
    cols = s * COLS + tl.arange(0, COLS)
    mm = tl.arange(0, BLOCK_M)
    qq = tl.arange(0, BLOCK_Q)
    if SUMMARY:
        qs = tl.load(QW + qq[:, None] * stride_q + cols[None, :], mask=(qq[:, None] < Q) & (cols < D)[None, :],
                     other=0.0).to(tl.float32)
    else:
        qw = tl.load(QW + cols, mask=cols < D, other=0.0).to(tl.float32)
    if HAS_OUT_NORM and PHASE != 1:
        out_w = tl.load(OUTW + cols, mask=cols < D, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    _trace(TRACE, (t * SPLIT + s) * 4)
    src = SRC + t * stride_src_t
    v, last, last_ptr = _chunk(src, DELTA + t * stride_delta_t, stride_src_m, mm, cols, M, D,
                               HAS_DELTA and PHASE != 2, RESET)
    v = tl.where(mm[:, None] == M - 1, last[None, :], v)  # all M sources, rows M .. BLOCK_M - 1 zero
    size = BLOCK_M * (BLOCK_M + BLOCK_Q)  # a program's part: the Gram, the queries' dots
    part = PART + t * SPLIT * size
    gg = mm[:, None] * BLOCK_M + mm[None, :]
    qg = BLOCK_M * BLOCK_M + qq[:, None] * BLOCK_M + mm[None, :]  # (BLOCK_Q 1: the [BLOCK_M] dots)
    if PHASE != 2:
        if HAS_DELTA:
            tl.store(last_ptr, last.to(SRC.dtype.element_ty), mask=cols < D)
        if IEEE:
            gram = tl.dot(v, tl.trans(v), input_precision="ieee")
        else:
            vs = v.to(SRC.dtype.element_ty)  # (exact: the sources' own values)
            gram = tl.dot(vs, tl.trans(vs), out_dtype=tl.float32)
        mine = part + s * size
        tl.store(mine + gg, gram)
        if SUMMARY:
            tl.store(mine + qg, tl.trans(_dot3(v, tl.trans(qs), IEEE)))
        else:
            tl.store(mine + BLOCK_M * BLOCK_M + mm, tl.sum(v * qw[None, :], 1))
        if PHASE == 0:
            _trace(TRACE, (t * SPLIT + s) * 4 + 1)
            barrier(TICKETS, group0 + t, SPLIT)
            _trace(TRACE, (t * SPLIT + s) * 4 + 2)
    if PHASE != 1:
        gram = tl.zeros([BLOCK_M, BLOCK_M], tl.float32)
        if SUMMARY:
            dots = tl.zeros([BLOCK_Q, BLOCK_M], tl.float32)
        else:
            dot = tl.zeros([BLOCK_M], tl.float32)
        for j in tl.static_range(SPLIT):  # a fixed order; unrolled, the loads in flight together
            gram += tl.load(part + j * size + gg, cache_modifier=".cg")
            if SUMMARY:
                dots += tl.load(part + j * size + qg, cache_modifier=".cg")
            else:
                dot += tl.load(part + j * size + BLOCK_M * BLOCK_M + mm, cache_modifier=".cg")
        sq = tl.sum(tl.where(mm[:, None] == mm[None, :], gram, 0.0), 1)
        if not SUMMARY:
            score = tl.where(mm < M, dot / tl.sqrt(sq / D + eps), float("-inf"))
            p = tl.exp(score - tl.max(score, 0))
            p = p / tl.sum(p, 0)
            mix = tl.sum(p[:, None] * v, 0)
            if HAS_OUT_NORM:
                total = tl.sum(tl.sum(p[:, None] * gram * p[None, :], 1), 0)
        else:  # every query's softmax; the blocks mixed by each, in the sources' dtype, high and low parts
            # (at most 2^-16 of it lost: 2^-17 rounded to nearest)
            score = tl.where(mm[None, :] < M, dots / tl.sqrt(sq / D + eps)[None, :], float("-inf"))
            top = tl.max(score, 1)
            w = tl.exp(score - top[:, None])
            total_w = tl.sum(w, 1)
            w = w / total_w[:, None]
            summ = tl.trans(_dot3(tl.trans(v), tl.trans(w), IEEE))
            high = summ.to(SRC.dtype.element_ty)
            ptrs = SUM + qq[:, None] * stride_sum_q + t * stride_sum_t + cols[None, :]
            smask = (qq[:, None] < Q) & (cols < D)[None, :]
            tl.store(ptrs, high, mask=smask)
            tl.store(ptrs + D, (summ - high.to(tl.float32)).to(SRC.dtype.element_ty), mask=smask)
            if s == 0:
                tl.store(LOGIT + qq * tl.num_programs(1) + t, top + tl.log(total_w), mask=qq < Q)
            # this mixer's mix: the summary's row 0; its sum of squares: row 0 of w G w' (its weights moved
            # into the sources' and the Gram's layouts instead: 8.7 -> 6.4 us a summary)
            mix = tl.sum(tl.where(qq[:, None] == 0, summ, 0.0), 0)
            if HAS_OUT_NORM:
                total = tl.sum(tl.where(qq == 0, tl.sum(w * tl.dot(w, gram, input_precision="ieee"), 1), 0.0), 0)
        if HAS_OUT_NORM:
            mix = mix / tl.sqrt(tl.maximum(total, 0.0) / D + eps) * out_w
        tl.store(OUT + t * stride_out_t + cols, mix.to(OUT.dtype.element_ty), mask=cols < D)
        if PHASE == 0:
            _trace(TRACE, (t * SPLIT + s) * 4 + 3)


@triton.jit
def _dot3(a, b, IEEE: tl.constexpr):
    """a @ b for fp32 a whose values are bf16 (the sources) and fp32 b: b as three bf16 parts (high,
    middle, low: its 24 bits), each through the tensor cores with a (exact products, fp32 sums: the
    FMA product of the queries took ~10 us of a 17.7 us summary, the parts as the left operand
    spilled); IEEE (fp32 sources, the interpreter): one fp32 product."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    b_hi = b.to(tl.bfloat16)
    rest = b - b_hi.to(tl.float32)
    b_mid = rest.to(tl.bfloat16)
    b_lo = (rest - b_mid.to(tl.float32)).to(tl.bfloat16)
    a = a.to(tl.bfloat16)
    return tl.dot(a, b_hi) + tl.dot(a, b_mid) + tl.dot(a, b_lo)


@triton.jit
def _trace(TRACE, i):
    if TRACE is not None:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        tl.store(TRACE + i, now)


@triton.jit
def _chunk(src, delta, stride_src_m, mm, cols, M, D, HAS_DELTA: tl.constexpr, RESET: tl.constexpr, rows=None):
    """Columns ``cols`` of the sources in fp32: the [BLOCK_M, CHUNK] tile of sources 0 .. M-2, the
    last source's vector (with HAS_DELTA its updated value, rounded to the sources' dtype) and that
    vector's addresses. ``rows`` (a block summary's high and low rows, D apart, M = 3): the tile
    from there, the last source at ``src``."""
    cmask = cols < D
    if rows is None:
        tile = tl.load(src + mm[:, None] * stride_src_m + cols[None, :], mask=(mm[:, None] < M - 1) & cmask[None, :],
                       other=0.0).to(tl.float32)
    else:
        tile = tl.load(rows + mm[:, None] * D + cols[None, :], mask=(mm[:, None] < M - 1) & cmask[None, :],
                       other=0.0).to(tl.float32)
    last_ptr = src + (M - 1) * stride_src_m + cols
    if HAS_DELTA:
        upd = tl.load(delta + cols, mask=cmask, other=0.0).to(tl.float32)
        if not RESET:
            upd += tl.load(last_ptr, mask=cmask, other=0.0).to(tl.float32)
        last = upd.to(src.dtype.element_ty).to(tl.float32)
    else:
        last = tl.load(last_ptr, mask=cmask, other=0.0).to(tl.float32)
    return tile, last, last_ptr


def launch_shape(M: int, D: int, T: int) -> dict:
    """Tile constants for M sources of width D and T tokens: the blocks' rows (a power of two, at
    least 2), the chunk (the tile / rows, at most MAX_CHUNK and the padded width), the chunks a row
    and the warps: as many as put every warp on the columns (the rows then sit in each thread, so the mix's sum
    over them needs no shared memory, and the last source's vector has the tile's column layout;
    warps on the rows cost 11x the ideal shared-memory wavefronts in the layout conversions)."""
    block_m = max(2, triton.next_power_of_2(max(M - 1, 1)))
    tile = TILE_FEW_TOKENS if T <= FEW_TOKENS else TILE
    chunk = min(MAX_CHUNK, triton.next_power_of_2(D), max(32, tile // block_m))
    warps = max(1, min(16, chunk // (32 * COLS_PER_THREAD)))
    n_chunks = triton.cdiv(D, chunk)
    return dict(BLOCK_M=block_m, CHUNK=chunk, N_CHUNKS=n_chunks, CHUNK_ROWS=triton.next_power_of_2(n_chunks),
                KEEP_LAST=int(KEEP_LAST and block_m <= KEEP_LAST_ROWS and T <= FEW_TOKENS), num_warps=warps)


def split_shape(M: int, D: int, T: int, device: torch.device) -> dict | None:
    """Columns a program and programs a token where a token's row is split (None: a program a
    token): the fewest columns (a power of two) that put the T x SPLIT programs on the SMs, one
    each, which the barrier needs (all resident at once)."""
    if T > min(SPLIT_TOKENS, BARRIER_SLOTS) or M > SPLIT_ROWS or M < SPLIT_MIN_SOURCES:
        return None
    sms, cols = sm_count(device), SPLIT_MIN_COLS
    while T * triton.cdiv(D, cols) > sms:
        cols *= 2
    if cols > SPLIT_MAX_COLS or cols >= D:
        return None
    return dict(COLS=cols, SPLIT=triton.cdiv(D, cols))


def split_parts(T: int, split: dict, device: torch.device, queries: int = 0) -> torch.Tensor:
    """The split kernel's parts: each program's Gram matrix and query dots, [T, SPLIT, rows x (rows +
    the queries' rows)] (``queries``: a summary's, SUMMARY_ROWS rows; 0: the plain mixer's one)."""
    q_rows = SUMMARY_ROWS if queries else 1
    return torch.empty(T, split["SPLIT"], SPLIT_ROWS * (SPLIT_ROWS + q_rows), dtype=torch.float32, device=device)


def launch_split(sources: torch.Tensor, query: torch.Tensor, eps: float, out_norm: torch.Tensor | None,
                 out: torch.Tensor, delta: torch.Tensor, split: dict, part: torch.Tensor, phase: int = 0,
                 has_delta: bool = False, reset: bool = False, trace: torch.Tensor | None = None,
                 summary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One launch of ``_attn_res_split_kernel`` at ``split`` (``split_shape``), its parts in ``part``
    (``split_parts``; the two phases of an interpreted run share them); ``trace``: int64
    [T * SPLIT * 4] for the programs' timer stamps (bench/attn_res_trace.py). The Gram in fp32 for
    fp32 sources and when interpreted (the interpreter's bf16 dot is wrong). ``summary`` (SUM [Q, T,
    2, D] in the sources' dtype, LOGIT [Q, T] fp32) with ``query`` [Q, D]: a block summary's launch."""
    M, T, D = sources.shape
    cols, n = split["COLS"], split["SPLIT"]
    counts = tickets(sources.device, (n + 1) * BARRIER_SLOTS, torch.int64)  # (a program count's own slots)
    extra = {} if summary is None else dict(
        SUM=summary[0], LOGIT=summary[1], Q=query.shape[0], stride_q=query.stride(0), stride_sum_q=summary[0].stride(0),
        stride_sum_t=summary[0].stride(1), BLOCK_Q=SUMMARY_ROWS, SUMMARY=True)
    _attn_res_split_kernel[(n, T)](
        sources, query, out_norm if out_norm is not None else query, out, delta, part, counts,
        n * BARRIER_SLOTS, sources.stride(0), sources.stride(1), out.stride(0), delta.stride(0), M, D,
        eps,
        HAS_OUT_NORM=out_norm is not None, BLOCK_M=SPLIT_ROWS, COLS=cols, SPLIT=n, PHASE=phase,
        IEEE=sources.dtype == torch.float32 or interpreted(), HAS_DELTA=has_delta, RESET=reset,
        TRACE=trace, **extra,
        num_warps=max(4 if summary is None else 8, min(16, cols // 128)), **pdl.launch(out.device))


def summary_shape(M: int, Q: int, D: int, T: int, device: torch.device) -> dict | None:
    """The split launch of a block summary (``attn_res_summary``) for M blocks and Q queries, or None
    where it cannot run (more tokens than the split takes, more than SUMMARY_ROWS queries)."""
    if Q > SUMMARY_ROWS or M > SPLIT_ROWS or T > min(SPLIT_TOKENS, BARRIER_SLOTS):
        return None
    sms, cols = sm_count(device), SPLIT_MIN_COLS
    while T * triton.cdiv(D, cols) > sms:
        cols *= 2
    if cols > SPLIT_MAX_COLS:
        return None
    return dict(COLS=cols, SPLIT=triton.cdiv(D, cols))


def attn_res_summary(sources: torch.Tensor, queries: torch.Tensor, eps: float, out_norm: torch.Tensor | None,
                     out_dtype, partial_update: tuple[torch.Tensor, bool] | None, summary: torch.Tensor,
                     logits: torch.Tensor) -> torch.Tensor:
    """A block's first mixer (sources [M, T, d]: the stored blocks only, the last one's pending
    ``partial_update`` done in the pass) and the summary of those blocks for every mixer of the
    block: queries [Q, d] (row 0 this mixer's) -> summary [Q, T, 2, d] in the sources' dtype, the
    blocks mixed by each query's softmax over them as high and low parts, logits [Q, T] fp32, the
    log of that softmax's total (reference: ``model.attn_res.block_summary``). Returns this mixer's
    output [T, d]. Needs ``summary_shape``."""
    M, T, D = sources.shape
    split = summary_shape(M, queries.shape[0], D, T, sources.device)
    if (split is None or sources.stride(2) != 1 or not summary.is_contiguous() or summary.dtype != sources.dtype
            or summary.shape != (queries.shape[0], T, 2, D)):
        raise ValueError(f"no block summary for {M} sources x {T} tokens x {D} and {queries.shape[0]} queries")
    delta, reset = partial_update if partial_update is not None else (sources[0], False)
    out = torch.empty(T, D, dtype=out_dtype, device=sources.device)
    part = split_parts(T, split, sources.device, queries.shape[0])
    for phase, has_delta in ((1, partial_update is not None), (2, False)) if interpreted() else \
            ((0, partial_update is not None),):
        launch_split(sources, queries, eps, out_norm, out, delta.contiguous(), split, part, phase, has_delta, reset,
                     summary=(summary, logits))
    return out


def attn_res_mix(sources: torch.Tensor, query: torch.Tensor, eps: float, out_norm: torch.Tensor | None = None,
                 out_dtype=torch.float32, partial_update: tuple[torch.Tensor, bool] | None = None,
                 summary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sources [M, T, d] (M <= 16); query [d]: the pseudo-query times the key-norm weight
    (``AttnResMixer.folded_query``); out_norm [d]: the RMSNorm weight applied to the mix (None for
    the final mixer). Returns [T, d] in ``out_dtype``, written by the kernel (no cast pass).
    ``partial_update`` (delta [T, d], reset): first sources[-1] += delta (reset: = delta), in
    place and rounded to the sources' dtype, as ``AttnResState`` would have done before the call.
    ``summary`` (summary [T, 2, d], logit [T]: this mixer's row of ``attn_res_summary``'s): the
    stored blocks given by it, sources [1, T, d] the partial alone."""
    M, T, D = sources.shape
    if summary is not None and (M != 1 or sources.stride(2) != 1 or not summary[0].is_contiguous()
                                or summary[1].stride(0) != 1 or summary[0].dtype != sources.dtype):
        raise ValueError("a summary's mix takes the partial alone, [1, T, d], and contiguous rows")
    if sources.stride(2) != 1:
        if partial_update is not None:
            raise ValueError("a partial update is written in place: the sources need a contiguous last dim")
        sources = sources.contiguous()
    delta, reset = partial_update if partial_update is not None else (sources[0], False)
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    out = torch.empty(T, D, dtype=out_dtype, device=sources.device)
    split = split_shape(M, D, T, sources.device) if summary is None else None
    if split is not None:
        part = split_parts(T, split, sources.device)
        # (interpreted: the barrier's two sides as two launches, the partial's update in the first)
        for phase, has_delta in ((1, partial_update is not None), (2, False)) if interpreted() else \
                ((0, partial_update is not None),):
            launch_split(sources, query, eps, out_norm, out, delta, split, part, phase, has_delta, reset)
        return out
    launch_token(sources, query, eps, out_norm, out, delta, partial_update is not None, reset, summary=summary)
    return out


def launch_token(sources: torch.Tensor, query: torch.Tensor, eps: float, out_norm: torch.Tensor | None,
                 out: torch.Tensor, delta: torch.Tensor, has_delta: bool = False, reset: bool = False,
                 trace: torch.Tensor | None = None, summary: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """One launch of ``_attn_res_kernel`` (a program a token) at ``launch_shape``; ``trace``: int64
    [T * 4] for the programs' timer stamps (bench/attn_res_trace.py --token). ``summary`` (a
    summary row [T, 2, d] and its logits [T]; sources the partial alone): three rows, the summary's
    two and the partial."""
    M, T, D = sources.shape
    stride_m, extra = sources.stride(0), {}
    if summary is not None:
        M, stride_m = 3, 0  # (the partial is the last source, at SRC)
        extra = dict(SUM=summary[0], LOGIT=summary[1], stride_sum_t=summary[0].stride(0), SUMMARY=True)
    _attn_res_kernel[(T,)](sources, query, out_norm if out_norm is not None else query, out, delta, stride_m,
                           sources.stride(1), out.stride(0), delta.stride(0), M, D, eps,
                           HAS_OUT_NORM=out_norm is not None, HAS_DELTA=has_delta, RESET=reset, TRACE=trace,
                           **extra, **launch_shape(M, D, T), **pdl.launch(out.device))

"""Split-KV MLA decode (``mla_decode_triton``'s split kernel) in Gluon, keys-major on wgmma.

Served (``mla_decode_triton.GLUON_SPLIT``): checked by bench/gpu_check_kernels.py, compiled for
sm_90 on CPU by tests/test_sm90_compile.py (Triton 3.6 and 3.9). H200, 32K context (RESULTS.md
fourteenth session): 16 heads 84 / 97 % of copy at batch 16 / 64, 32 heads 80 / 94 %, 96 heads
0.44 ms (the Triton kernel's best 0.78).

Why: the Triton kernel reaches 83-99 % of copy at 16 heads but 61-71 % at 32 (kimi-linear on one
GPU: 60 flop a latent byte): its head-major tiles put the heads on the MMA's M, which Triton fills
with mma.sync at 16-32 heads; a keys-major Triton variant spilled (RESULTS.md eleventh session).
Here the 64-key tile is the wgmma's M and the head block its N (FlashMLA's shape):
scores^T [keys, heads] = K [keys, 576] @ Q^T; out^T [512, heads] += K_c^T [512, keys] @ P^T, the
latent tile read from shared memory by both wgmmas (the transposed view for the second), P^T
through 4 KB of shared memory. The key tiles stream through a 2-stage cp.async ring of whole
pages (64 rows of 1,152 bytes); the online softmax runs over the tile's rows (keys) per column
(head). One warpgroup a program; 189 KB of shared memory: one program an SM (compiled, 3.6:
234 registers, no spills, 925 instructions a thread a 64-key tile, 68 wgmmas).

From ``HEADS_MAJOR_MIN`` (64) heads the step runs heads-major instead (``_mla_decode_heads_kernel``,
two warpgroups, 64 heads as the wgmma's M): with all of K3's 96 heads on one GPU (DP attention,
DCP) the decode is compute-bound, and 32-wide wgmmas on keys left it at ~36 % of the matmul
ceiling. H200, 32K context (RESULTS.md forty-seventh session): 96 heads 44-46 % (0.37 against
0.44 ms at batch 16 with either form's best split count; 0.57 at the old default), 128 heads 56-60 %
against 37 %. Those heads are served by the same blocks in FlashMLA's seesaw schedule
(``_mla_decode_seesaw_kernel``, ``SEESAW``): warp-specialised, the two warpgroups' softmaxes under
each other's wgmmas, 1.14-1.17x the heads-major step at 96 heads (forty-eighth session); with each
warpgroup's own P first and the key pages copied by TMA from a producer warp, 1.32-1.37x
(forty-ninth session: 96 heads 0.285 / 1.05 ms at batch 16 / 64, 32K; 128 heads 77 % of matmul).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_compat import async_load, cta_barrier, gluon_pdl_start, tma_load

from . import pdl
from .mla_decode_triton import split_range


BLOCK_N = gl.constexpr(64)  # keys a tile: the wgmma's M, one page of the latent cache
BLOCK_H = 32  # heads a program: the wgmma's N
# Launched with PDL (``gluon_compat.gluon_pdl_start``), in the decode step's chain (-1 to -3 us a
# kimi-linear batch-1 step's 7 calls, RESULTS.md twenty-third session); False: a plain launch (A/B).
PDL = True
D_C = gl.constexpr(512)  # latent (kv_lora_rank) width the layouts are written for
D_PE = gl.constexpr(64)  # its rotary part
# Launch order: True puts a sequence's head blocks next to each other (grid (head blocks, B, splits)),
# so the programs reading the same key pages run side by side; False: B fastest. L2 already kept the
# DRAM reads single either way (ncu, RESULTS.md forty-ninth session: 608-627 MB for 604 MB of latent
# at 96 heads), but the seesaw step at 96 / 128 heads gains 1-3 % in this order.
HEAD_BLOCKS_FIRST = True


@gluon.jit
def _program(HEAD_BLOCKS_FIRST: gl.constexpr):
    """This program's (sequence, head block, split) in the launch order ``HEAD_BLOCKS_FIRST``."""
    if HEAD_BLOCKS_FIRST:
        b = gl.program_id(1)
        hb = gl.program_id(0)
    else:
        b = gl.program_id(0)
        hb = gl.program_id(1)
    return b, hb, gl.program_id(2)


@gluon.jit
def _tile_base(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, PAGE: gl.constexpr, WIDTH: gl.constexpr):
    """The cache address of the key tile at n0 (its page from the block table; PAGE % BLOCK_N == 0),
    page 0's past the split."""
    page = gl.load(BT + b * stride_btb + (n0 // PAGE) * stride_btp, mask=n0 < end, other=0).to(gl.int64)
    return KV + page * stride_kvp + (n0 % PAGE) * WIDTH


@gluon.jit
def _copy_tile(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kc_slot, kp_slot, rc, cc, cp,
               PAGE: gl.constexpr, WIDTH: gl.constexpr):
    """Start copying the key tile at n0 into a ring slot; rows at or past ``end`` are not read
    (zero-filled), a tile past the split copies nothing."""
    base = _tile_base(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, PAGE, WIDTH)
    live = gl.expand_dims(n0 + rc < end, 1)
    async_load(kc_slot, base + gl.expand_dims(rc * WIDTH, 1) + gl.expand_dims(cc, 0), mask=live)
    async_load(kp_slot, base + gl.expand_dims(rc * WIDTH, 1) + D_C + gl.expand_dims(cp, 0), mask=live)
    async_copy.commit_group()


@gluon.jit
def _load_queries(QC, QP, b, h0, H, stride_qb, stride_qh, stride_pb, stride_ph, ROWS: gl.constexpr,
                  copy_l: gl.constexpr):
    """Heads h0 .. h0 + ROWS - 1 of sequence b's queries (rows past H zero), latent and rotary
    parts, in registers; and the copy layout's column indices (cc, cp)."""
    hq = h0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, copy_l))
    qmask = gl.expand_dims(hq < H, 1)
    cc = gl.arange(0, D_C, layout=gl.SliceLayout(0, copy_l))
    cp = gl.arange(0, D_PE, layout=gl.SliceLayout(0, copy_l))
    qc = gl.load(QC + b * stride_qb + gl.expand_dims(hq * stride_qh, 1) + gl.expand_dims(cc, 0), mask=qmask, other=0.0)
    qp = gl.load(QP + b * stride_pb + gl.expand_dims(hq * stride_ph, 1) + gl.expand_dims(cp, 0), mask=qmask, other=0.0)
    return qc, qp, cc, cp


@gluon.jit
def _queries_and_ring(QC, QP, b, h0, H, stride_qb, stride_qh, stride_pb, stride_ph, ROWS: gl.constexpr,
                      copy_l: gl.constexpr):
    """Heads h0 .. h0 + ROWS - 1 of sequence b's queries into shared memory (rows past H zero), and
    the 2-slot ring the key pages stream through. Returns (q_c, q_p, kc, kp) and the copy layout's
    row and column indices (rc, cc, cp) for ``_copy_tile``."""
    qc, qp, cc, cp = _load_queries(QC, QP, b, h0, H, stride_qb, stride_qh, stride_pb, stride_ph, ROWS, copy_l)
    q_c = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_C], gl.NVMMASharedLayout.get_default_for([ROWS, D_C],
                                                                                                 gl.bfloat16), qc)
    q_p = gl.allocate_shared_memory(gl.bfloat16, [ROWS, D_PE], gl.NVMMASharedLayout.get_default_for([ROWS, D_PE],
                                                                                                  gl.bfloat16), qp)
    kc = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_C],
                                   gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_C], gl.bfloat16))
    kp = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_PE],
                                   gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], gl.bfloat16))
    rc = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, copy_l))
    return q_c, q_p, kc, kp, rc, cc, cp


@gluon.jit
def _mla_decode_split_kernel(
    QC, QP, KV, BT, SL, O, LSE,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kvp, stride_btb, stride_btp, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, scale, H, NUM_SPLITS,
    PAGE: gl.constexpr, BLOCK_H: gl.constexpr, USE_PDL: gl.constexpr = False,
    HEAD_BLOCKS_FIRST: gl.constexpr = False,
):
    """Program (sequence, head block, split): the split's keys in tiles of BLOCK_N, the partial
    output [heads, D_C] and its log-sum-exp as ``mla_decode_triton``'s split kernel writes them."""
    WIDTH: gl.constexpr = D_C + D_PE
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_H, 16])  # [keys, heads] and [D_C, heads]
    p_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # 16-byte copies along a row
    gluon_pdl_start(USE_PDL)
    b, hb, sp = _program(HEAD_BLOCKS_FIRST)
    start, end = split_range(SL, b, sp, NUM_SPLITS, BLOCK_N)
    # ---- the head block's queries into shared memory (the scores' B operand) -------------------
    q_c, q_p, kc, kp, rc, cc, cp = _queries_and_ring(QC, QP, b, hb * BLOCK_H, H, stride_qb, stride_qh, stride_pb,
                                                     stride_ph, BLOCK_H, copy_l)
    p_t = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], p_s)
    _copy_tile(KV, BT, b, start, end, stride_btb, stride_btp, stride_kvp, kc.index(0), kp.index(0), rc, cc, cp, PAGE, WIDTH)
    fence_async_shared()  # the queries, stored by every thread, before any wgmma reads them
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(0, s_l))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(0, s_l))
    acc = gl.zeros([D_C, BLOCK_H], gl.float32, s_l)  # out^T
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_l))
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    for t in range(0, n_tiles):
        slot = (t % 2).to(gl.int32)  # seq_lens may be int64: ring indices must be int32
        n0 = start + t * BLOCK_N
        # the next tile's copy into the other slot (its previous wgmmas completed last iteration)
        _copy_tile(KV, BT, b, n0 + BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc.index(1 - slot),
                   kp.index(1 - slot), rc, cc, cp, PAGE, WIDTH)
        async_copy.wait_group(1)
        cta_barrier()
        fence_async_shared()
        k_c, k_p = kc.index(slot), kp.index(slot)
        s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, s_l)
        s = warpgroup_mma(k_c, q_c.permute([1, 0]), s, use_acc=False, is_async=True)
        s = warpgroup_mma(k_p, q_p.permute([1, 0]), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where(gl.expand_dims(n0 + keys < end, 1), s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - gl.expand_dims(m_new, 0))
        l_i = l_i * alpha + gl.sum(p, 0)
        m_i = m_new
        p_t.store(p.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()  # every warp's part of P^T before the wgmma reads it
        acc = warpgroup_mma(k_c.permute([1, 0]), p_t, acc * gl.expand_dims(alpha, 0), is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)
    has = l_i > 0
    out = acc / gl.expand_dims(gl.where(has, l_i, 1.0), 0)
    lse = gl.where(has, m_i + gl.log(gl.where(has, l_i, 1.0)), float("-inf"))
    ho = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, s_l))
    do = gl.arange(0, D_C, layout=gl.SliceLayout(1, s_l))
    gl.store(O + b * stride_ob + gl.expand_dims(ho * stride_oh, 0) + sp * stride_os + gl.expand_dims(do, 1), out,
             mask=gl.expand_dims(ho < gl.where(start < end, H, 0), 0))  # (an empty split: its -inf alone)
    gl.store(LSE + b * stride_lb + ho * stride_lh + sp, lse, mask=ho < H)


# Heads from which the split step runs heads-major (``_mla_decode_heads_kernel``): K3's 96 heads on one
# GPU (DP attention, DCP) make the decode compute-bound (~2 flop a latent byte a head), where the
# keys-major kernel's 32-wide wgmmas reach ~30 % of the matmul ceiling. None: keys-major always.
HEADS_MAJOR_MIN = 64
BLOCK_M = gl.constexpr(64)  # heads a heads-major program: the wgmma's M


@gluon.jit
def _mla_decode_heads_kernel(
    QC, QP, KV, BT, SL, O, LSE,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kvp, stride_btb, stride_btp, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, scale, H, NUM_SPLITS,
    PAGE: gl.constexpr, USE_PDL: gl.constexpr = False,
    HEAD_BLOCKS_FIRST: gl.constexpr = False,
):
    """Program (sequence, block of 64 heads, split), two warpgroups, FlashMLA's orientation: the
    64 heads are the wgmma's M, scores [heads, keys] = Q @ K^T (each warpgroup 32 of a tile's 64
    keys, the queries read from shared memory by both), the row maximum across the two, P [heads,
    keys] through 8 KB of shared memory, then out [heads, D_C] += P @ K_c with each warpgroup
    owning 256 of the 512 latent columns (128 fp32 registers a thread). Shared memory: the queries
    (72 KB), a 2-stage ring of key pages (144 KB), P (8 KB): one program an SM. Same splits and
    partial outputs as ``_mla_decode_split_kernel``; rows past H are zero queries, never stored."""
    WIDTH: gl.constexpr = D_C + D_PE
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, 32, 16])  # [heads, keys]
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, 256, 16])  # [heads, D_C]
    p_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.bfloat16)
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte copies along a row
    gluon_pdl_start(USE_PDL)
    b, hb, sp = _program(HEAD_BLOCKS_FIRST)
    start, end = split_range(SL, b, sp, NUM_SPLITS, BLOCK_N)
    q_c, q_p, kc, kp, rc, cc, cp = _queries_and_ring(QC, QP, b, hb * BLOCK_M, H, stride_qb, stride_qh, stride_pb,
                                                     stride_ph, BLOCK_M, copy_l)
    p_sm = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_N], p_s)
    _copy_tile(KV, BT, b, start, end, stride_btb, stride_btp, stride_kvp, kc.index(0), kp.index(0), rc, cc, cp, PAGE, WIDTH)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_l))
    l_acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l)  # the row sums, reduced once at the end
    acc = gl.zeros([BLOCK_M, D_C], gl.float32, o_l)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    n_tiles = gl.cdiv(end - start, BLOCK_N)
    for t in range(0, n_tiles):
        slot = (t % 2).to(gl.int32)  # seq_lens may be int64: ring indices must be int32
        n0 = start + t * BLOCK_N
        async_copy.wait_group(0)
        # Every thread's part of tile t (and, first time, of the queries) in, and both warpgroups
        # past tile t - 1's wgmmas: only now may its slot (the copy below) and P be overwritten.
        cta_barrier()
        fence_async_shared()
        k_c, k_p = kc.index(slot), kp.index(slot)
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l)
        s = warpgroup_mma(q_c, k_c.permute([1, 0]), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_p, k_p.permute([1, 0]), s, is_async=True)
        # The next tile's copy issued under the scores' wgmmas: its block-table load and address
        # arithmetic no longer stand before them (4-5 % at 64-128 heads, RESULTS.md forty-seventh session).
        _copy_tile(KV, BT, b, n0 + BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc.index(1 - slot),
                   kp.index(1 - slot), rc, cc, cp, PAGE, WIDTH)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where(gl.expand_dims(n0 + keys < end, 0), s * scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        alpha = gl.exp(m_i - m_new)
        p = gl.exp(s - gl.expand_dims(m_new, 1))
        l_acc = l_acc * gl.expand_dims(alpha, 1) + p
        m_i = m_new
        p_sm.store(p.to(gl.bfloat16))
        fence_async_shared()
        cta_barrier()  # both warpgroups' keys of P before either wgmma reads it
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_l))
        acc = warpgroup_mma(p_sm, k_c, acc * gl.expand_dims(alpha_o, 1), is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
    async_copy.wait_group(0)
    l_i = gl.convert_layout(gl.sum(l_acc, 1), gl.SliceLayout(1, o_l))
    m_o = gl.convert_layout(m_i, gl.SliceLayout(1, o_l))
    has = l_i > 0
    out = acc / gl.expand_dims(gl.where(has, l_i, 1.0), 1)
    lse = gl.where(has, m_o + gl.log(gl.where(has, l_i, 1.0)), float("-inf"))
    ho = hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_l))
    do = gl.arange(0, D_C, layout=gl.SliceLayout(0, o_l))
    gl.store(O + b * stride_ob + gl.expand_dims(ho * stride_oh, 1) + sp * stride_os + gl.expand_dims(do, 0), out,
             mask=gl.expand_dims(ho < gl.where(start < end, H, 0), 1))  # (an empty split: its -inf alone)
    gl.store(LSE + b * stride_lb + ho * stride_lh + sp, lse, mask=ho < H)


# ---- seesaw (FlashMLA's schedule) ------------------------------------------------------------------
# The heads-major step above runs each tile's two phases in lockstep in both warpgroups: the tensor
# cores idle through the softmax, the output's rescale and the barriers (about half a tile's time at
# 96 heads, RESULTS.md forty-seventh session). The seesaw step (FlashMLA's new kernel, its deep-dive
# write-up) takes tiles in pairs: warpgroup 0 scores tile 0 while warpgroup 1 scores tile 1, each
# owns half of the output's 512 columns, and they trade row maxima and P through shared memory, so
# one warpgroup's softmax runs under the other's wgmmas. Warp-specialised (a partition a warpgroup);
# each warpgroup streams its own half of the key columns back in as soon as it has read them last.
# H200, 32K context (RESULTS.md forty-eighth session): 96 heads 0.321 / 0.640 / 1.248 ms at batch
# 16 / 32 / 64 against 0.375 / 0.740 / 1.424 (1.14-1.17x), 128 heads 60-64 % of the matmul ceiling;
# with each warpgroup's own P first and head blocks first in the launch order (forty-ninth session)
# 96 heads 0.30-0.31 / 1.16-1.18 ms at batch 16 / 64, 128 heads 1.18-1.20 ms at 64 (70 %); with the
# pages by TMA (SEESAW_TMA) 0.285 / 1.05 and 1.08 (77 %).
# True: served from HEADS_MAJOR_MIN heads instead of ``_mla_decode_heads_kernel``.
SEESAW = True
HALF = gl.constexpr(256)  # output (and key) columns a warpgroup owns
SEESAW_WORKER_REGS = gl.constexpr(240)  # warpgroup 1's registers (warpgroup 0 gets what is left: 256)
# True: the ring's pages copied by TMA from a producer warp (``_seesaw_producer``), FlashMLA's way, so
# no copy bookkeeping sits in the warpgroups: 2.5-6 % faster at 96 / 128 heads (forty-ninth session).
# Where the cache's pages are not a whole number of rows apart (``tma_ring_applies``), or False: each
# warpgroup copies its own shares by cp.async.
SEESAW_TMA = True
SEESAW_TMA_WORKER_REGS = gl.constexpr(232)  # warpgroup 1's with the producer's warpgroup (4 warps' worth) at
SEESAW_PRODUCER_REGS = gl.constexpr(24)  # its 24; warpgroup 0 keeps 256
LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _copy_cols(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, dst, COL0: gl.constexpr,
               NCOLS: gl.constexpr, PAGE: gl.constexpr, WIDTH: gl.constexpr, layout: gl.constexpr):
    """cp.async of the key tile at n0, columns COL0 .. COL0 + NCOLS - 1, into ``dst`` [BLOCK_N, NCOLS]
    (rows at or past ``end`` zero-filled; a tile past the split copies nothing)."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, NCOLS, layout=gl.SliceLayout(0, layout))
    base = _tile_base(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, PAGE, WIDTH) + COL0
    async_load(dst, base + gl.expand_dims(rows * WIDTH, 1) + gl.expand_dims(cols, 0),
               mask=gl.expand_dims(n0 + rows < end, 1))


@gluon.jit
def _opaque(x):
    """``x`` through an impure move: smem views indexed by it are rebuilt in the loop (a few
    uniform adds), not hoisted with their ~80 wgmma descriptors, which spilled."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _seesaw_refill(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kc, kp, slot: gl.constexpr, bars,
                   W: gl.constexpr, WITH_PE: gl.constexpr, PAGE: gl.constexpr):
    """Warpgroup W's share of the tile at n0 into ring slot ``slot``: its half of the latent columns
    (and the rotary part where it frees that too), then a per-thread arrival on ready[slot * 2 + W]
    once the copies have landed."""
    ready = bars.index(slot * 2 + W)
    WIDTH: gl.constexpr = D_C + D_PE
    half_l: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    pe_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    _copy_cols(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kc.index(slot).slice(W * HALF, HALF, dim=1),
               W * HALF, HALF, PAGE, WIDTH, half_l)
    if WITH_PE:
        _copy_cols(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kp.index(slot), D_C, D_PE, PAGE, WIDTH,
                   pe_l)
    async_copy.mbarrier_arrive(ready, increment_count=False)
    async_copy.commit_group()


@gluon.jit
def _seesaw_release(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kc, kp, slot: gl.constexpr, bars,
                    W: gl.constexpr, WITH_PE: gl.constexpr, PAGE: gl.constexpr, TMA: gl.constexpr):
    """Warpgroup W is done reading its share of ring slot ``slot``: with ``TMA`` it tells the producer
    warp (free[slot * 2 + W], bars 10-13), else it copies the tile at n0 in itself."""
    if TMA:
        cta_barrier()  # (every warp's wgmma reads of the slot retired before the one arrival)
        mbarrier.arrive(bars.index(10 + slot * 2 + W), count=1)
    else:
        _seesaw_refill(KV, BT, b, n0, end, stride_btb, stride_btp, stride_kvp, kc, kp, slot, bars, W, WITH_PE, PAGE)


@gluon.jit
def _tma_fill(KV_DESC, kc, kp, bars, BT, b, n0, end, stride_btb, stride_btp, rows_per_page, r,
              slot: gl.constexpr, W: gl.constexpr, WITH_PE: gl.constexpr, PAGE: gl.constexpr):
    """The producer's copy of warpgroup W's share of the tile at n0 into ring slot ``slot`` (as
    ``_seesaw_refill`` splits it), in 64-column TMA boxes on ready[slot * 2 + W], once the share's
    last reader of round r - 1 has freed it. Rows past ``end`` are copied as the page holds them
    (the scoring warpgroup zeroes them: ``_zero_rows``)."""
    ready = bars.index(slot * 2 + W)
    page = gl.load(BT + b * stride_btb + (n0 // PAGE) * stride_btp, mask=n0 < end, other=0)
    row = (page * rows_per_page + n0 % PAGE).to(gl.int32)  # (TMA coordinates are 32-bit; seq_lens may be int64)
    mbarrier.wait(bars.index(10 + slot * 2 + W), ((r + 1) & 1).to(gl.int32), pred=r > 0)
    mbarrier.expect(ready, (HALF + WITH_PE * D_PE) * BLOCK_N * 2)
    for j in gl.static_range(HALF // D_PE):
        tma_load(KV_DESC, [row, W * HALF + j * D_PE], ready, kc.index(slot).slice(W * HALF + j * D_PE, D_PE, dim=1))
    if WITH_PE:
        tma_load(KV_DESC, [row, D_C], ready, kp.index(slot))


@gluon.jit
def _seesaw_producer(KV_DESC, kc, kp, bars, BT, b, start, end, stride_btb, stride_btp, rows_per_page,
                     PAGE: gl.constexpr):
    """One warp issuing the ring's copies by TMA: each round's four shares in the order their
    readers free them (slot 0's left half mid-round by warpgroup 0, slot 1's right half by
    warpgroup 1 after its own product, then the halves read with the other warpgroup's P, warpgroup
    0's ending first: it does not wait for the other's maximum to start)."""
    n_rounds = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)
    for r in range(0, n_rounds):
        n0 = start + 2 * r * BLOCK_N
        _tma_fill(KV_DESC, kc, kp, bars, BT, b, n0, end, stride_btb, stride_btp, rows_per_page, r, 0, 0, False, PAGE)
        _tma_fill(KV_DESC, kc, kp, bars, BT, b, n0 + BLOCK_N, end, stride_btb, stride_btp, rows_per_page, r, 1, 1,
                  False, PAGE)
        _tma_fill(KV_DESC, kc, kp, bars, BT, b, n0 + BLOCK_N, end, stride_btb, stride_btp, rows_per_page, r, 1, 0,
                  True, PAGE)
        _tma_fill(KV_DESC, kc, kp, bars, BT, b, n0, end, stride_btb, stride_btp, rows_per_page, r, 0, 1, True, PAGE)


@gluon.jit
def _zero_rows(tile, keys):
    """Rows ``keys`` .. BLOCK_N - 1 of a [BLOCK_N, D_C] ring page to zero (a TMA copy brings the
    page's rows past the sequence as they are; P is zero there, but 0 x NaN is not)."""
    z_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    live = gl.expand_dims(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, z_l)) < keys, 1)
    for c in gl.static_range(D_C // D_PE):
        piece = tile.slice(c * D_PE, D_PE, dim=1)
        piece.store(gl.where(live, piece.load(z_l), 0.0))


@gluon.jit
def _seesaw_partition(W: gl.constexpr, kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H,
                      stride_kvp, stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
                      qk_scale2, PAGE: gl.constexpr, TMA: gl.constexpr):
    """Warpgroup W of the seesaw step. Round r takes tiles 2r (ring slot 0) and 2r + 1 (slot 1);
    warpgroup W scores tile 2r + W and accumulates out[:, W*256 : W*256 + 256] over both (scores in
    log2 units, m the running row maximum):
      W0: S0 = Q K0^T; m0 = max(m, rowmax S0) -> W1; P0 = exp(S0 - m0) -> W1;
          O_L = O_L exp(m - m0) + P0 V0_L; m1 <- W1; O_L = O_L exp(m0 - m1) + P1 V1_L
      W1: S1 = Q K1^T; m0 <- W0; m1 = max(m0, rowmax S1) -> W0; P1 = exp(S1 - m1) -> W0;
          O_R = O_R exp(m - m1) + P1 V1_R; P0 <- W0; O_R = O_R + (P0 exp(m0 - m1)) V0_R
    Each warpgroup applies its own P first, from registers (FlashMLA's order: warpgroup 1's half of
    slot 1, which its next scores wait for first, is refilled mid-round; 6-9 % faster than taking
    P0 first, RESULTS.md forty-ninth session); the other's P travels through the rotary rows of the
    P's slot (read only by that slot's scores, already done); warpgroup 1 rescales P0 in registers. bars: 0-3 ready[slot * 2 +
    loader] (128 per-thread arrivals on cp.async completion), 4 m0, 5 m1, 6 P0, 7 P1, 8-9 the row
    sums at the end. Each warpgroup refills the ring with what it read last: its half of both
    slots' latent columns, and the rotary rows of the other warpgroup's slot."""
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)
    V: gl.constexpr = 1 - W  # the other warpgroup
    if not TMA:  # round 0's tiles: this warpgroup's half of both slots, and the rotary part of the other's slot
        _seesaw_refill(KV, BT, b, start, end, stride_btb, stride_btp, stride_kvp, kc, kp, 0, bars, W, W == 1, PAGE)
        _seesaw_refill(KV, BT, b, start + BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc, kp, 1, bars, W,
                       W == 0, PAGE)
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_l))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_s)
    acc = gl.zeros([BLOCK_M, HALF], gl.float32, o_l)
    xm0, xm1 = xm.slice(0, BLOCK_M), xm.slice(BLOCK_M, BLOCK_M)
    n_rounds = gl.cdiv(gl.cdiv(end - start, BLOCK_N), 2)
    for r in range(0, n_rounds):
        ph = (r & 1).to(gl.int32)  # (seq_lens may be int64)
        zero = ph - ph
        n0 = start + 2 * r * BLOCK_N  # slot 0's tile; slot 1's is the next
        own = _opaque(W + zero)  # (values the compiler cannot hoist: see _opaque)
        oth = _opaque(V + zero)
        k_c, k_p = kc.index(own), kp.index(own)
        q_i = _opaque(2 + zero)
        q_c, q_p = kc.index(q_i), kp.index(q_i)
        # scores of this warpgroup's tile: its own column half first (refilled by itself), then the rest
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_l)
        mbarrier.wait(bars.index(2 * W + W), ph)
        if not TMA:
            fence_async_shared()  # (cp.async writes through the generic proxy; wgmma reads through the async one)
        s = warpgroup_mma(q_c.slice(W * HALF, HALF, dim=1), k_c.slice(W * HALF, HALF, dim=1).permute([1, 0]), s,
                          use_acc=False, is_async=True)
        mbarrier.wait(bars.index(2 * W + V), ph)
        if not TMA:
            fence_async_shared()
        s = warpgroup_mma(q_c.slice(V * HALF, HALF, dim=1), k_c.slice(V * HALF, HALF, dim=1).permute([1, 0]), s,
                          is_async=True)
        s = warpgroup_mma(q_p, k_p.permute([1, 0]), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        s = gl.where(gl.expand_dims(n0 + W * BLOCK_N + keys < end, 0), s * qk_scale2, float("-inf"))
        if TMA:  # a partial (or empty) tile's rows past the keys, zeroed before anyone's P V reads them
            if end - (n0 + W * BLOCK_N) < BLOCK_N:
                _zero_rows(k_c, end - (n0 + W * BLOCK_N))
                fence_async_shared()
        if W == 0:
            m0 = gl.maximum(m_i, gl.max(s, 1))
            xm0.store(m0)
            mbarrier.arrive(bars.index(4), count=1)
            alpha = gl.exp2(m_i - m0)  # the running output's scale to this warpgroup's new maximum
        else:
            mbarrier.wait(bars.index(4), ph)
            m0 = xm0.load(row_s)
            m1 = gl.maximum(m0, gl.max(s, 1))
            xm1.store(m1)
            mbarrier.arrive(bars.index(5), count=1)
            alpha = gl.exp2(m_i - m1)
        p = gl.exp2(s - gl.expand_dims(m0 if W == 0 else m1, 1))
        p16 = p.to(gl.bfloat16)
        k_p.store(p16)  # for the other warpgroup, over this tile's rotary rows
        fence_async_shared()
        mbarrier.arrive(bars.index(6 + W), count=1)
        if W == 0:
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = warpgroup_mma(gl.convert_layout(p16, p_op), k_c.slice(0, HALF, dim=1),
                                acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1), is_async=True)
            mbarrier.wait(bars.index(5), ph)
            m1 = xm1.load(row_s)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _seesaw_release(KV, BT, b, n0 + 2 * BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc, kp, 0, bars,
                            0, False, PAGE, TMA)
            a1 = gl.exp2(m0 - m1)
            l_i = l_i * a1
            mbarrier.wait(bars.index(7), ph)
            acc = warpgroup_mma(kp.index(oth), kc.index(oth).slice(0, HALF, dim=1),
                                acc * gl.expand_dims(gl.convert_layout(a1, row_o), 1), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _seesaw_release(KV, BT, b, n0 + 3 * BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc, kp, 1, bars,
                            0, True, PAGE, TMA)
        else:  # its own product first (its half of slot 1 refilled mid-round), then P0 rescaled to m1 here
            l_i = l_i * alpha + gl.sum(p, 1)
            acc = warpgroup_mma(gl.convert_layout(p16, p_op), k_c.slice(HALF, HALF, dim=1),
                                acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1), is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _seesaw_release(KV, BT, b, n0 + 3 * BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc, kp, 1, bars,
                            1, False, PAGE, TMA)
            mbarrier.wait(bars.index(6), ph)
            p0 = kp.index(oth).load(p_op).to(gl.float32) * gl.expand_dims(
                gl.convert_layout(gl.exp2(m0 - m1), gl.SliceLayout(1, p_op)), 1)
            acc = warpgroup_mma(p0.to(gl.bfloat16), kc.index(oth).slice(HALF, HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _seesaw_release(KV, BT, b, n0 + 2 * BLOCK_N, end, stride_btb, stride_btp, stride_kvp, kc, kp, 0, bars,
                            1, True, PAGE, TMA)
        m_i = m1
    async_copy.wait_group(0)
    # the row sums: each warpgroup's share, both relative to the final maximum
    xm.slice((2 + W) * BLOCK_M, BLOCK_M).store(l_i)
    mbarrier.arrive(bars.index(8 + W), count=1)
    mbarrier.wait(bars.index(8 + V), 0)
    l_i = gl.convert_layout(l_i + xm.slice((2 + V) * BLOCK_M, BLOCK_M).load(row_s), row_o)
    m_o = gl.convert_layout(m_i, row_o)
    has = l_i > 0
    out = acc / gl.expand_dims(gl.where(has, l_i, 1.0), 1)
    ho = hb * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_o)
    do = W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(0, o_l))
    gl.store(O + b * stride_ob + gl.expand_dims(ho * stride_oh, 1) + sp * stride_os + gl.expand_dims(do, 0), out,
             mask=gl.expand_dims(ho < gl.where(start < end, H, 0), 1))  # (an empty split: its -inf alone)
    if W == 0:
        lse = gl.where(has, (m_o + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + b * stride_lb + ho * stride_lh + sp, lse, mask=ho < H)


@gluon.jit
def _seesaw_worker(kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp, stride_btb,
                   stride_btp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, qk_scale2, PAGE: gl.constexpr,
                   TMA: gl.constexpr):
    _seesaw_partition(1, kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                      stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, qk_scale2, PAGE,
                      TMA)


@gluon.jit
def _seesaw_default(kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp, stride_btb,
                    stride_btp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, qk_scale2, PAGE: gl.constexpr,
                   TMA: gl.constexpr):
    _seesaw_partition(0, kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                      stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, qk_scale2, PAGE,
                      TMA)


@gluon.jit
def _mla_decode_seesaw_kernel(
    QC, QP, KV, BT, SL, O, LSE,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kvp, stride_btb, stride_btp, stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh, scale, H, NUM_SPLITS,
    PAGE: gl.constexpr, USE_PDL: gl.constexpr = False,
    HEAD_BLOCKS_FIRST: gl.constexpr = False, KV_DESC=None, TMA: gl.constexpr = False,
):
    """Program (sequence, block of 64 heads, split) in FlashMLA's seesaw schedule
    (``_seesaw_partition``): the default partition is warpgroup 0, one worker partition warpgroup 1;
    with ``TMA`` a one-warp partition copies the ring's pages (``_seesaw_producer``, KV_DESC: the
    cache as [rows, D_C + D_PE] in [64, 64] boxes), else each warpgroup its own shares by cp.async.
    Same splits and partial outputs as ``_mla_decode_heads_kernel``. Shared memory: the queries
    (72 KB), two key pages (144 KB; P travels in the rotary rows a page's scores are done with),
    the exchanged row maxima and sums, 10 mbarriers."""
    copy_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    gluon_pdl_start(USE_PDL)
    b, hb, sp = _program(HEAD_BLOCKS_FIRST)
    start, end = split_range(SL, b, sp, NUM_SPLITS, BLOCK_N)
    # the queries as a third page of the ring's buffers: a view the loop indexes through _opaque
    qc, qp, cc, cp = _load_queries(QC, QP, b, hb * BLOCK_M, H, stride_qb, stride_qh, stride_pb, stride_ph, BLOCK_M,
                                   copy_l)
    kc = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_N, D_C],
                                   gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_C], gl.bfloat16))
    kp = gl.allocate_shared_memory(gl.bfloat16, [3, BLOCK_N, D_PE],
                                   gl.NVMMASharedLayout.get_default_for([BLOCK_N, D_PE], gl.bfloat16))
    kc.index(2).store(qc)
    kp.index(2).store(qp)
    xm = gl.allocate_shared_memory(gl.float32, [4 * BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    bars = gl.allocate_shared_memory(gl.int64, [16, 1], mbarrier.MBarrierLayout())  # (10 used, 14 with TMA)
    for i in gl.static_range(4):  # a TMA transaction, or a cp.async arrival from every thread of the loader
        mbarrier.init(bars.index(i), count=1 if TMA else 128)
    for i in gl.static_range(4, 14 if TMA else 10):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()  # the queries and the barriers, before either partition's wgmmas and waits
    if TMA:  # (the partitions' arguments written out: a tuple held in a variable makes the constexprs values)
        gl.warp_specialize([(_seesaw_default, (kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                                               stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb,
                                               stride_lh, scale * LOG2E, PAGE, TMA)),
                            (_seesaw_worker, (kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                                              stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb,
                                              stride_lh, scale * LOG2E, PAGE, TMA)),
                            (_seesaw_producer, (KV_DESC, kc, kp, bars, BT, b, start, end, stride_btb, stride_btp,
                                                stride_kvp // (D_C + D_PE), PAGE))],
                           [4, 1], [SEESAW_TMA_WORKER_REGS, SEESAW_PRODUCER_REGS])
    else:
        gl.warp_specialize([(_seesaw_default, (kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                                               stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb,
                                               stride_lh, scale * LOG2E, PAGE, TMA)),
                            (_seesaw_worker, (kc, kp, xm, bars, KV, BT, O, LSE, b, hb, sp, start, end, H, stride_kvp,
                                              stride_btb, stride_btp, stride_ob, stride_oh, stride_os, stride_lb,
                                              stride_lh, scale * LOG2E, PAGE, TMA))],
                           [4], [SEESAW_WORKER_REGS])


def mla_decode_split_gluon(q_abs: torch.Tensor, q_pe: torch.Tensor, latent_pages: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, partial: torch.Tensor,
                           lse: torch.Tensor, scale: float) -> None:
    """``mla_decode_triton``'s split step into ``partial`` [B, H, S, D_C] / ``lse`` [B, H, S], for
    latent widths D_C + D_PE, pages of whole key tiles, bf16 queries and cache; heads in blocks of
    ``BLOCK_H`` keys-major (out^T alone is 128 registers a thread at 32: a block of 64 spills and
    overflows shared memory with one warpgroup), or of 64 heads-major from ``HEADS_MAJOR_MIN`` (the
    seesaw schedule where ``SEESAW``)."""
    B, H, _ = q_abs.shape
    page = latent_pages.shape[1]
    if (q_abs.shape[-1], q_pe.shape[-1]) != (D_C.value, D_PE.value) or page % BLOCK_N.value \
            or latent_pages.dtype != torch.bfloat16:
        raise ValueError(f"the Gluon MLA decode takes {D_C} + {D_PE} latent widths, pages of multiples of {BLOCK_N} "
                         f"keys and a bf16 cache (got {q_abs.shape[-1]} + {q_pe.shape[-1]}, page {page}, "
                         f"{latent_pages.dtype})")
    if latent_pages.stride(0) % 8 or latent_pages.data_ptr() % 16:
        raise ValueError("the Gluon MLA decode copies 16-byte pieces of 16-byte aligned pages")
    if not heads_major_applies(H):
        kernel, block, extra = _mla_decode_split_kernel, BLOCK_H, dict(BLOCK_H=BLOCK_H, num_warps=4)
    elif SEESAW:
        kernel, block, extra = _mla_decode_seesaw_kernel, BLOCK_M.value, dict(num_warps=4)
        if tma_ring_applies(latent_pages):
            extra.update(KV_DESC=_ring_descriptor(latent_pages), TMA=True)
    else:
        kernel, block, extra = _mla_decode_heads_kernel, BLOCK_M.value, dict(num_warps=8)
    blocks = triton.cdiv(H, block)
    kernel[(blocks, B, partial.shape[2]) if HEAD_BLOCKS_FIRST else (B, blocks, partial.shape[2])](
        q_abs, q_pe, latent_pages, block_table, seq_lens, partial, lse,
        q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), latent_pages.stride(0),
        block_table.stride(0), block_table.stride(1), partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
        lse.stride(1), scale, H, partial.shape[2], PAGE=page, HEAD_BLOCKS_FIRST=HEAD_BLOCKS_FIRST, **extra,
        **(pdl.launch(partial.device) if PDL else {}))


def tma_ring_applies(latent_pages: torch.Tensor) -> bool:
    """Whether the seesaw step takes the cache by TMA (``SEESAW_TMA``): rows of D_C + D_PE contiguous,
    pages a whole number of rows apart (the pool's pages: every MLA layer's rows of a page in a run)."""
    width = D_C.value + D_PE.value
    return SEESAW_TMA and latent_pages.stride()[1:] == (width, 1) and latent_pages.stride(0) % width == 0


def _ring_descriptor(latent_pages: torch.Tensor):
    """The cache as one [rows, D_C + D_PE] tensor of [BLOCK_N, D_PE] boxes: page p's row k is row
    p * stride(0) / width + k (rows between pages, other layers', are never addressed)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    width = D_C.value + D_PE.value
    rows = (latent_pages.shape[0] - 1) * (latent_pages.stride(0) // width) + latent_pages.shape[1]
    box = [BLOCK_N.value, D_PE.value]
    return TensorDescriptor(latent_pages, [rows, width], [width, 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))


def heads_major_applies(heads: int) -> bool:
    """Whether the split step for ``heads`` runs heads-major (``HEADS_MAJOR_MIN``)."""
    return HEADS_MAJOR_MIN is not None and heads >= HEADS_MAJOR_MIN


def heads_per_program(heads: int) -> int:
    """Heads a split program takes (``mla_decode_triton.default_num_splits`` counts programs by it)."""
    return BLOCK_M.value if heads_major_applies(heads) else BLOCK_H

"""The MXFP4 grouped expert GEMM over MMA-layout weights in Gluon (Triton's explicit-layout
dialect): the same computation as ``moe_triton`` "mx_mma", written so that what the Triton
language cannot guarantee is stated and checked by the compiler. It serves decode row blocks
(``moe_triton.GLUON_DECODE``): K3's experts at 1 / 16 / 64 tokens 63 / 77 / 71 % of copy on the
H200 with row blocks of 8 (58 / 70 / 68 % with 16) against "mx_mma"'s 39 / 49 / 48 % (RESULTS.md
fourteenth session), and prefill ones (below). Checked against fp32 matmuls of the exact
dequantisation by bench/gpu_check_kernels.py, compiled for sm_90 on CPU by
tests/test_sm90_compile.py (Triton 3.6 and 3.9).

Why it is faster (RESULTS.md twelfth and thirteenth sessions; ``bench/gluon_probe.py``):
- a double buffer of K steps of cp.async copies (activations, weight words, E8M0 bytes) keeps the
  next step's bytes in flight while this one computes; the first version without it, loads
  issued at use, was slower than "mx_mma" (43 % at 16 tokens), and a register prefetch carried
  the bytes one per register (132 registers a thread). Each thread copies and later reads its
  own weight words and scale bytes, so only the activations need a barrier, one a step: each slot
  of the buffer is its own allocations (so the compiler proves the copies into one and the reads of
  the other disjoint), and every wgmma of a step retires at its end, so the refill of the other
  slot starts right after that barrier (fifty-ninth session: the ring of two slots indexed at run
  time had three barriers a step; K3's experts at 1 / 16 / 64 / 256 tokens 5-10 % faster);
- the weight words load in a [16-row block, lane, byte] layout, one warp a block, and the
  upcast tile converts to the wgmma register operand with ``assert_trivial=True``;
- the E8M0 scale is folded into the upcast's exact multiply (2^(E8M0 - 1) per row, two rows a
  word), so one accumulator chain runs over the whole K loop: needs E8M0 <= 128 (weights up to 12
  in magnitude), checked once at load (``moe.RoutedExperts.folded_scales``);
- wgmma runs async, at most one group (gate and up: two) in flight, the first K step peeled so
  the loop's zero-trip path never hands ptxas a zero-moved accumulator (C7515 serialisation).
Programs: (row block of BLOCK_M assignment rows, 64 weight rows), 4 warps, K steps of 128 codes.

Prefill (``moe_triton.GLUON_PREFILL``): K3's experts at 8K tokens in 24.4 ms against "mx_mma"'s
47.1, 50 % of the bf16 matmul ceiling (RESULTS.md fifteenth session), from the 8-warp STACKED
form, row blocks of mixed sizes (``expert_sort.sort_by_expert_sizes``: fewer upcasts, less
padding) and programs ordered column tile fastest (``COLS_FIRST_MIN_ROWS``). (The fourteenth
session's 4-warp kernel at rows of 64: 36.6 ms.) A PAIRED mode (gate and up rows on one chain,
half the accumulator registers, so row blocks of 128 fit) checked correct but measured slower at
both 64 rows (43.3 ms) and 128 (62.8), so it was removed.

STACKED (``warps=8``; serves prefill row blocks of 64 and 128, fifteenth session): one
accumulator chain of 128 weight rows over two warpgroups, each warp upcasting 16 rows of one
matrix (with GLU: warpgroup 0 the gate's 64 rows, 1 the same up rows, paired after the loop
through shared memory; without: 128 output columns). At row blocks of 128 with GLU: 128
registers, 83 KB, 253 instructions a warp a K step for 2.1M MACs (the 4-warp kernel at 64 rows:
414 for 1M), so ~40 % fewer upcast instructions per MAC, against more padding (K3 at 8K tokens:
~146 rows an expert, 57 % of 256 rows useful against 76 % of 192).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from . import pdl
from .gluon_compat import async_load, cta_barrier, gluon_pdl_launch_dependents, gluon_pdl_start, gluon_pdl_wait

from .glu_triton import glu
from .moe_triton import _E2M1_WORD_TO_BF16_ASM



# ``_E2M1_WORD_TO_BF16_ASM`` with each mul.rn.bf16x2 by the row's 2^(E8M0 - 1) instead of the
# constant 2^126 ($5: bytes 0 and 2's row g twice; $6: bytes 1 and 3's row g + 8).
_text = _E2M1_WORD_TO_BF16_ASM.value
for _i, _m in enumerate(("$5", "$6", "$5", "$6")):
    _text = _text.replace(f"mul.rn.bf16x2 ${_i}, a, two126", f"mul.rn.bf16x2 ${_i}, a, {_m}")
_SCALED_WORD_TO_BF16_ASM = gl.constexpr(_text)

BLOCK_N = 64  # weight rows a program: four 16-row blocks, one a warp
GROUPS = gl.constexpr(4)  # 32-code groups a K step (a row's E8M0 bytes of a step: one 4-byte copy)
BLOCK_K = 32 * GROUPS.value
# (a ring of 3-5 K steps lost to 2 by 12-20 % on K3's decode, twelfth-fourteenth sessions; so two slots, fixed)
# Row blocks read their gathered activations once per column tile: ordered row block fastest, the
# ~260 programs in flight hold ~260 row blocks' (K3 prefill: ~240 MB, past L2) and the re-reads go
# to DRAM; column tile fastest they hold a few. K3 on the H200 (fifteenth session): 8K tokens 24.4
# ms against 28.2, 256 tokens (row blocks of 16) 4.50 against 4.92; None: row block fastest always.
COLS_FIRST_MIN_ROWS = 16
# Launched in the decode step's PDL chain (ops/pdl.py; False: plain launches, for A/B timing), and
# where the caller allows (``gluon_grouped_gemm(prefetch=)``: the down GEMM) with the weights'
# first ring steps copied before the wait.
PDL = True
# The gate / up GEMM with its GLU epilogue (unsplit: K3's decode steps, kimi-linear -q past 3 tokens) stays
# out of the chain: K3's at one token lost ~14 us a layer in it (k3-slice on the H200, the gate / up 250 against
# 193 us a step charged, the down after it 141 against 120; RESULTS.md fifty-sixth session), where kimi-linear
# -q's split gate / up gained ~1.2 us a layer.
PDL_UNSPLIT_GLU = False
PREFETCH = True
# Split partials stored from the wgmma accumulator's registers, not through the bf16 rows' shared-memory
# transposition (sm_90 SASS of kimi-linear -q's split gate / up: 4 -> 1 barriers, no shared-memory round trip);
# and a program's expert and rows loaded with its first row (volatile: not sunk behind the padding test), so the
# first copies wait for one load's latency after the PDL wait, not two. Both off until checked and timed on the
# H200 (sixtieth session: compiled and inspected on CPU only, no device lent): `bash bench/gpu_session.sh
# gluonpdl` with AB="on:k3serve.ops.moe_gluon.ACC_STORE=True,k3serve.ops.moe_gluon.EARLY_ROWS=True;off:".
ACC_STORE = False
EARLY_ROWS = False


@gluon.jit
def _weight_group(packed, scale, BLOCKS: gl.constexpr, word_l: gl.constexpr, mult_l: gl.constexpr,
                  a_l: gl.constexpr):
    """The scaled bf16 weight tile [16 * BLOCKS, 32] of one group as the wgmma register operand,
    from its packed words [block, lane, byte] and E8M0 bytes [block, lane, h] (rows g, g + 8)."""
    mult = ((scale.to(gl.int16) + 126) << 7).to(gl.bfloat16, bitcast=True)  # 2^(E8M0 - 1)
    mult = gl.convert_layout(gl.join(mult, mult).reshape([BLOCKS, 32, 1, 2, 2]), mult_l, assert_trivial=True)
    mult = gl.broadcast(mult, packed.reshape([BLOCKS, 32, 2, 2, 2]).to(gl.bfloat16))[0]  # to the bytes (s, h, q0)
    mult = gl.convert_layout(mult.reshape([BLOCKS, 32, 8]), word_l, assert_trivial=True)
    lo, hi = gl.inline_asm_elementwise(_SCALED_WORD_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, mult],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    w = gl.join(lo, hi).reshape([BLOCKS, 8, 4, 2, 2, 2, 2]).permute([0, 4, 1, 3, 6, 2, 5]).reshape([16 * BLOCKS, 32])
    return gl.convert_layout(w, a_l, assert_trivial=True)  # rows (block, h, g); k (s, o, c, q0)


@gluon.jit
def _copy_step(i, slot, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps, TWO: gl.constexpr,
               WHAT: gl.constexpr = 0):
    """Start the asynchronous copies of K step i (GROUPS 32-code groups) into ``slot`` (``_slot``'s
    buffers): each group's gathered activations [BLOCK_M, 32], the weight words each thread later
    reads itself (its own bytes: no barrier needed for them), and the step's E8M0 bytes of the 64
    gate and up rows (4 a row, one copy each). A step past the end copies nothing (masked) but still
    commits its group, so the wait counts stay uniform. Every copy lands in its own allocation, so
    the compiler puts no barrier between them. WHAT: 0 all of it, 1 the weights and scales only, 2
    the activations only (PREFETCH: a step's weights before the PDL wait, its activations after)."""
    xs, ws, wus, ss = slot
    live = i < n_steps
    for g in gl.static_range(GROUPS):
        kk = i * (32 * GROUPS) + 32 * g
        if WHAT != 1:
            async_load(xs[g], x_ptrs + kk,
                       mask=gl.full(x_ptrs.shape, 1, gl.int1, x_ptrs.type.layout) & live)
        if WHAT != 2:
            w_at = (i * GROUPS + g) * 256
            async_load(ws[g], W_e + w_offs + w_at, mask=wmask & live)
            if TWO:
                async_load(wus[g], WU_e + w_offs + w_at, mask=wmask & live)
    if WHAT != 2:
        async_load(ss, s_ptrs + i * GROUPS, mask=smask & live)
    async_copy.commit_group()


@gluon.jit
def _four(dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """One allocation a group (GROUPS == 4): copies into different allocations need no barrier."""
    return (gl.allocate_shared_memory(dtype, shape, layout), gl.allocate_shared_memory(dtype, shape, layout),
            gl.allocate_shared_memory(dtype, shape, layout), gl.allocate_shared_memory(dtype, shape, layout))


@gluon.jit
def _slot(BLOCK_M: gl.constexpr, WARPS: gl.constexpr, TWO: gl.constexpr, x_s: gl.constexpr, flat: gl.constexpr,
          flat2: gl.constexpr):
    """One slot of the double buffer, all its own allocations: activations, gate and up words a
    group (without TWO the gate's twice, the up's unused), the step's E8M0 bytes."""
    ws = _four(gl.uint8, [WARPS, 32, 8], flat)
    return (_four(gl.bfloat16, [BLOCK_M, 32], x_s), ws, _four(gl.uint8, [WARPS, 32, 8], flat) if TWO else ws,
            gl.allocate_shared_memory(gl.uint8, [128, GROUPS], flat2))


@gluon.jit
def _groups(s4, BLOCKS: gl.constexpr):
    """[block, lane, h, GROUPS] E8M0 bytes -> GROUPS tensors [block, lane, h] (registers only)."""
    a, b = gl.split(s4.reshape([BLOCKS, 32, 2, 2, 2]))  # group = 2 * j1 + j0: split j0
    s0, s2 = gl.split(a)
    s1, s3 = gl.split(b)
    return s0, s1, s2, s3


@gluon.jit
def _step_scales(rows, sg_l: gl.constexpr, scale_l: gl.constexpr, STACKED: gl.constexpr):
    """A step's E8M0 bytes of the 64 gate and 64 up rows (or STACKED: the 128 rows of the 8 warps'
    blocks, gate's then up's with GLU) [128, GROUPS] (shared) -> for each of gate and up (STACKED:
    all, twice), GROUPS tensors [block, lane, h] of rows g, g + 8 (lane = 4g + c): each
    (block, g) read once, broadcast over c by the lanes that already hold it."""
    if STACKED:
        s = rows.reshape([8, 2, 8, GROUPS]).permute([0, 2, 1, 3]).load(gl.SliceLayout(2, sg_l))  # blk, g, h, j
        s = gl.expand_dims(s, 2) + gl.zeros([8, 8, 4, 2, GROUPS], gl.uint8, sg_l)
        gate = _groups(gl.convert_layout(s.reshape([8, 32, 2, GROUPS]), scale_l, assert_trivial=True), 8)
        up = gate  # (one chain: unused)
    else:
        s = rows.reshape([2, 4, 2, 8, GROUPS]).permute([0, 1, 3, 2, 4]).load(gl.SliceLayout(3, sg_l))  # m, blk, g, h, j
        s = gl.expand_dims(s, 3) + gl.zeros([2, 4, 8, 4, 2, GROUPS], gl.uint8, sg_l)
        gate, up = gl.split(s.reshape([2, 4, 32, 2, GROUPS]).permute([1, 2, 3, 4, 0]))
        gate = _groups(gl.convert_layout(gate, scale_l, assert_trivial=True), 4)
        up = _groups(gl.convert_layout(up, scale_l, assert_trivial=True), 4)
    return gate, up


@gluon.jit
def _k_step(acc, acc_up, i, cur, nxt, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps,
            TWO: gl.constexpr, FIRST: gl.constexpr, word_l: gl.constexpr, scale_l: gl.constexpr,
            sg_l: gl.constexpr, mult_l: gl.constexpr, a_l: gl.constexpr, STACKED: gl.constexpr):
    """K step i from slot ``cur`` (``_slot``'s buffers): wait for its copies, make the activations
    visible to the wgmma (barrier + async-proxy fence), start step i + 1's copies into the other slot
    ``nxt`` (every wgmma that read it retired before each warp reached the barrier), then per group
    upcast and issue the (gate's) wgmma, and the up's with TWO chains, keeping this group's in
    flight, and retire them all at the end."""
    xs, ws, wus, ss = cur
    async_copy.wait_group(0)
    cta_barrier()  # (also: every thread's scale copies of this step landed)
    fence_async_shared()
    _copy_step(i + 1, nxt, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps, TWO)
    BLOCKS: gl.constexpr = 8 if STACKED else 4
    s_gate, s_up = _step_scales(ss, sg_l, scale_l, STACKED)
    for g in gl.static_range(GROUPS):
        xb = xs[g].permute([1, 0])  # [32, BLOCK_M]
        w = _weight_group(ws[g].load(word_l), s_gate[g], BLOCKS, word_l, mult_l, a_l)
        acc = warpgroup_mma(w, xb, acc, use_acc=not (FIRST and g == 0), is_async=True)
        if TWO:
            wu = _weight_group(wus[g].load(word_l), s_up[g], BLOCKS, word_l, mult_l, a_l)
            acc_up = warpgroup_mma(wu, xb, acc_up, use_acc=not (FIRST and g == 0), is_async=True)
            acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc_up])
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    return warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_up])


@gluon.jit
def _grouped_gemm_kernel(X, W, S, W_UP, S_UP, OUT, ROWS, EXPERTS, ROW_SCALE,
                         num_assign, top_k, N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_on,
                         beta, linear_beta, static_expert0, GLU: gl.constexpr, SITU: gl.constexpr,
                         LINEAR_CLIP: gl.constexpr, HAS_ROW_SCALE: gl.constexpr, BLOCK_M: gl.constexpr,
                         WARPS: gl.constexpr = 4, COLS_FIRST: gl.constexpr = False,
                         SPLIT_K: gl.constexpr = 1, USE_PDL: gl.constexpr = False, PREFETCH: gl.constexpr = False,
                         STATIC_TAIL: gl.constexpr = 0, ACC_STORE: gl.constexpr = True,
                         EARLY_ROWS: gl.constexpr = True):
    """out[rows, 64 cols] = (GLU of) x_rows @ W[e][cols]^T (scaled MXFP4, MMA layout), times the
    rows' routing weights with HAS_ROW_SCALE. Weight tiles are the wgmma's register operand (M =
    weight rows), the gathered activations its shared-memory operand (N = BLOCK_M rows); every
    operand streams through a double buffer of K steps of cp.async copies. GLU: two accumulator
    chains (gate, up) over the same 64 columns. WARPS = 8 (STACKED, prefill): one chain of 128
    weight rows over two warpgroups, each warp upcasting one 16-row block of one matrix (with GLU
    warpgroup 0 the gate's 64 rows, 1 the same up rows, paired after the loop through shared
    memory; without, 128 output columns), so a program's row block of 128 fits (64 accumulator
    registers a thread) and each upcast weight tile serves twice the rows of the 4-warp kernel's.
    SPLIT_K > 1 (4 warps; decode steps whose programs are too few to fill the GPU): program
    (.., .., split) runs the split's K / SPLIT_K and stores fp32 partials in row ``row * SPLIT_K +
    split``, with GLU the gate's in columns [0, N) and the up's in [N, 2N), GLU not applied: the
    caller sums them in a fixed order (``glu_triton``, ``moe_triton.combine_experts``).

    In a PDL chain (USE_PDL; ops/pdl.py says what may be read before the wait): PREFETCH (the
    caller's word that ROWS and EXPERTS were written two or more launches back: the down GEMM)
    starts the first step's weight and scale copies before the wait, the activations'
    after it; STATIC_TAIL (``moe_triton.grouped_gemm``'s: the last row blocks are one assignment
    each of the constant experts static_expert0, ...) runs those blocks' whole K loop before the
    wait, which they take only to store."""
    STACKED: gl.constexpr = WARPS == 8
    TWO: gl.constexpr = GLU and not STACKED
    COLS: gl.constexpr = 128 if STACKED and not GLU else 64  # output columns a program (BLOCK_N)
    word_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [WARPS, 1, 1], [2, 1, 0])  # [block, lane, byte]
    scale_l: gl.constexpr = gl.BlockedLayout([1, 1, 2, GROUPS], [1, 32, 1, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
    mult_l: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2, 2], [1, 32, 1, 1, 1], [WARPS, 1, 1, 1, 1],
                                            [4, 3, 2, 1, 0])
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    if BLOCK_M >= 32:  # [row, k]: 16-byte copies along k, 8 rows a warp a pass
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [WARPS, 1], [1, 0])
    elif BLOCK_M == 16:  # 8-byte copies, 16 rows a pass (no thread idle at 16 rows)
        x_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    else:  # 8 rows (wgmma N = 8): 4-byte copies, every thread one
        x_l: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [4, 1], [1, 0])
    x_s: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[2, 1, 0])
    # the scale copies [mat, row, j] (4 bytes a thread) and their read, broadcast over lanes 4g + c
    scp_l: gl.constexpr = gl.BlockedLayout([1, GROUPS], [32, 1], [WARPS, 1], [1, 0])  # (8 warps: rows copied twice)
    flat2: gl.constexpr = gl.SwizzledSharedLayout(vec=GROUPS, per_phase=1, max_phase=1, order=[1, 0])
    if STACKED:  # [block, g, c, h, j]
        sg_l: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, GROUPS], [1, 8, 4, 1, 1], [8, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    else:  # [mat, block, g, c, h, j]
        sg_l: gl.constexpr = gl.BlockedLayout([2, 1, 1, 1, 2, GROUPS], [1, 1, 8, 4, 1, 1], [1, 4, 1, 1, 1, 1],
                                              [0, 5, 4, 3, 2, 1])
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [WARPS, 1], [1, 0])
    pair_l: gl.constexpr = gl.BlockedLayout([1, 4, 2], [4, 8, 1], [WARPS, 1, 1], [2, 1, 0])  # [col, row, gate | up]
    pid_m = gl.program_id(1 if COLS_FIRST else 0)
    pid_n = gl.program_id(0 if COLS_FIRST else 1)
    pid_s = gl.program_id(2)
    if STATIC_TAIL:
        first_static = gl.num_programs(1 if COLS_FIRST else 0) - STATIC_TAIL
        static = pid_m >= first_static
        if static:  # (its wait comes before its store)
            gluon_pdl_launch_dependents(USE_PDL)
        else:
            gluon_pdl_start(USE_PDL)
        e = gl.where(static, static_expert0 + pid_m - first_static,
                     gl.load(EXPERTS + pid_m, mask=pid_m < first_static, other=0, volatile=EARLY_ROWS)).to(gl.int64)
    else:
        if not PREFETCH:
            gluon_pdl_start(USE_PDL)
        e = gl.load(EXPERTS + pid_m, volatile=EARLY_ROWS).to(gl.int64)
    # (its expert and rows loaded with its first row: one load's latency before the copies, not two; volatile, so
    # the compiler does not sink them behind the test)
    rows = gl.load(ROWS + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, x_l)), volatile=EARLY_ROWS)
    # Row blocks of padding only (valid rows lead each block) stream no weights.
    if gl.load(ROWS + pid_m * BLOCK_M) < num_assign:
        # Padding rows read token 0 (their columns of the product are never stored); rows < num_assign fit 32 bits.
        tok = gl.where(rows < num_assign, rows.to(gl.int32) // top_k, 0).to(gl.int64)
        xk = gl.arange(0, 32, layout=gl.SliceLayout(0, x_l))
        x_ptrs = X + gl.expand_dims(tok * (stride_xt // 4) * 4, 1) + gl.expand_dims(xk, 0)
        bi = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, word_l)))  # a warp's 16-row block
        if STACKED and GLU:  # blocks 4-7: the up rows of blocks 0-3, reached from gate's pointer by their
            # distance (a multiple of 16 bytes, checked by the wrapper; a pointer select loses the
            # alignment in Triton 3.9's analysis)
            blk = pid_n * 4 + bi % 4
            w_row = blk * 16 * stride_wn + (bi // 4).to(gl.int64) * ((W_UP.to(gl.int64) - W.to(gl.int64)) // 16 * 16)
        else:
            blk = pid_n * WARPS + bi
            w_row = blk * 16 * stride_wn
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, word_l)))
        byte = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, word_l)))
        w_offs = gl.expand_dims(gl.expand_dims(w_row, 1), 2) \
            + gl.expand_dims(gl.expand_dims(lane * 8, 0), 2) + gl.expand_dims(gl.expand_dims(byte, 0), 1)
        wmask = gl.expand_dims(gl.expand_dims(blk * 16 < N, 1), 2)
        # E8M0 bytes: the step's 4 a row, one 4-byte copy each, for the 64 gate and 64 up rows
        rws = gl.arange(0, 128, layout=gl.SliceLayout(1, scp_l))
        srow = pid_n * COLS + rws % COLS
        sj = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, scp_l))
        s_offs = gl.expand_dims(srow * (stride_sn // 4) * 4, 1) + gl.expand_dims(sj, 0)
        smask = gl.expand_dims(srow < N, 1)
        s0 = _slot(BLOCK_M, WARPS, TWO, x_s, flat, flat2)
        s1 = _slot(BLOCK_M, WARPS, TWO, x_s, flat, flat2)
        # (strides rounded as the wrapper checked they are: the copies' 8- and 4-byte alignment)
        w_at, s_at = e * (stride_we // 8) * 8, e * (stride_se // 4) * 4
        W_e, WU_e = W + w_at, W_UP + w_at
        up_at = (S_UP.to(gl.int64) - S.to(gl.int64)) // 16 * 16
        s_ptrs = S + s_at + gl.expand_dims((rws // COLS).to(gl.int64) * up_at, 1) + s_offs
        n_steps = K // (32 * GROUPS) // SPLIT_K
        if SPLIT_K > 1:  # this split's K steps: later groups of every 16-row block, scale bytes and activations
            step0 = pid_s * n_steps
            W_e, WU_e = W_e + step0 * (GROUPS * 256), WU_e + step0 * (GROUPS * 256)
            x_ptrs = x_ptrs + step0 * (32 * GROUPS)
            s_ptrs = s_ptrs + step0 * GROUPS
        if PREFETCH:  # the weights' first step in flight before the wait, the activations' after
            _copy_step(0, s0, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps, TWO, 1)
            gluon_pdl_start(USE_PDL)
            _copy_step(0, s0, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps, TWO, 2)
        else:
            _copy_step(0, s0, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps, TWO)
        acc = gl.zeros([16 * WARPS, BLOCK_M], gl.float32, layout=mma_l)
        acc_up = gl.zeros([16 * WARPS, BLOCK_M], gl.float32, layout=mma_l)
        acc, acc_up = _k_step(acc, acc_up, 0, s0, s1, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps,
                              TWO, True, word_l, scale_l, sg_l, mult_l, a_l, STACKED)
        for i in range(1, n_steps, 2):  # steps 1, 2, ... from slots 1, 0, ...: two steps a trip, static slots
            acc, acc_up = _k_step(acc, acc_up, i, s1, s0, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask, n_steps,
                                  TWO, False, word_l, scale_l, sg_l, mult_l, a_l, STACKED)
            if i + 1 < n_steps:
                acc, acc_up = _k_step(acc, acc_up, i + 1, s0, s1, W_e, WU_e, x_ptrs, w_offs, wmask, s_ptrs, smask,
                                      n_steps, TWO, False, word_l, scale_l, sg_l, mult_l, a_l, STACKED)
        async_copy.wait_group(0)
        if STACKED and GLU:  # rows r and r + 64 (gate and up of one column) into one thread: [64, BLOCK_M, 2]
            acc, acc_up = gl.split(gl.convert_layout(acc.reshape([2, 64, BLOCK_M]).permute([1, 2, 0]), pair_l))
        if GLU and SPLIT_K == 1:
            acc = glu(acc, acc_up, beta, linear_beta, SITU, LINEAR_CLIP, False)
        y = gl.permute(acc, [1, 0])  # [rows, cols]
        if SPLIT_K == 1 or not ACC_STORE:  # bf16 rows: 8-byte stores, through shared memory
            y = gl.convert_layout(y, out_l)
        # (split fp32 partials straight from the accumulator's registers: a warp's stores still fill whole
        # 32-byte sectors, and the epilogue takes no shared-memory transposition and its barriers)
        y_l: gl.constexpr = y.type.layout
        orow = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, y_l))
        rows_o = gl.load(ROWS + orow)
        valid_o = rows_o < num_assign
        if HAS_ROW_SCALE:  # the routing weight of each assignment
            y = y * gl.expand_dims(gl.load(ROW_SCALE + gl.where(valid_o, rows_o, 0), mask=valid_o, other=0.0), 1)
        cols = pid_n * COLS + gl.arange(0, COLS, layout=gl.SliceLayout(0, y_l))
        dst = OUT + gl.expand_dims(rows_o * SPLIT_K + pid_s, 1) * stride_on + gl.expand_dims(cols, 0)
        omask = gl.expand_dims(valid_o, 1) & gl.expand_dims(cols < N, 0)
        if STATIC_TAIL:
            if static:  # (the output may be memory the previous kernel still reads)
                gluon_pdl_wait(USE_PDL)
        gl.store(dst, y.to(OUT.dtype.element_ty), mask=omask)
        if GLU and SPLIT_K > 1:
            gl.store(dst + N, gl.convert_layout(gl.permute(acc_up, [1, 0]), y_l).to(OUT.dtype.element_ty),
                     mask=omask)
    else:  # (every program waits, so the next kernel's wait covers every kernel before this one)
        if PREFETCH:
            gluon_pdl_start(USE_PDL)
        if STATIC_TAIL:
            if static:
                gluon_pdl_wait(USE_PDL)


def gluon_grouped_gemm(x: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, num_assign: int,
                       top_k: int, weight: torch.Tensor, scale: torch.Tensor, n_out: int, block_m: int,
                       up: tuple | None = None, act: tuple = ("silu", 1.0, None),
                       out_dtype: torch.dtype = torch.float32, row_scale: torch.Tensor | None = None,
                       maxnreg: int | None = None, warps: int = 4,
                       out: torch.Tensor | None = None, cols_first: bool | None = None,
                       split_k: int = 1, prefetch: bool = False, static_tail: int = 0,
                       static_expert0: int = 0) -> torch.Tensor:
    """``moe_triton.grouped_gemm``'s contract for MMA-layout MXFP4 weights and bf16 activations
    (K a multiple of ``BLOCK_K``, E8M0 bytes <= ``mxfp4.MMA_MAX_SCALE``: the caller's load-time check);
    ``maxnreg`` caps registers a thread (occupancy);
    ``warps`` 8: the STACKED kernel (one chain of 128 weight rows over two warpgroups; row blocks
    of 64 or 128). With 4 warps, row blocks of 128 serve the single GEMM only (two accumulator
    chains of 64 x 128 do not fit). ``cols_first``: programs ordered column tile fastest (a row
    block's programs run together and share its gathered activations in L2), by default from row
    blocks of ``COLS_FIRST_MIN_ROWS`` up. ``split_k`` > 1 (4 warps, fp32 out): the kernel's SPLIT_K
    partials, out [num_assign * split_k, n_out (x 2 with ``up``)], for the caller to sum. In the
    decode step's PDL chain (``PDL``): ``prefetch``, the weights' first copies before the wait
    (``rows`` and ``block_expert`` written two or more launches back); ``static_tail``,
    ``static_expert0``: as ``moe_triton.grouped_gemm``'s."""
    K = x.shape[1]
    if K % BLOCK_K or x.dtype != torch.bfloat16 or block_m not in (8, 16, 32, 64, 128):
        raise ValueError(f"the Gluon grouped GEMM takes bf16 activations, K % {BLOCK_K} == 0 and row blocks of "
                         f"8 to 128 (got {x.dtype}, K={K}, block_m={block_m})")
    if warps not in (4, 8) or (warps == 8 and block_m not in (64, 128)):
        raise ValueError(f"the Gluon grouped GEMM runs 4 warps, or 8 at row blocks of 64 or 128 (got {warps} warps, "
                         f"row blocks of {block_m})")
    if split_k < 1 or (K // BLOCK_K) % split_k or (split_k > 1 and (warps != 4 or out_dtype != torch.float32)):
        raise ValueError(f"split_k={split_k}: K's {K // BLOCK_K} steps of {BLOCK_K} must split evenly, and a split "
                         f"GEMM runs 4 warps into fp32 partials (got {warps} warps, {out_dtype})")
    if block_m == 128 and up is not None and warps == 4:
        raise ValueError("gate / up row blocks of 128 need 8 warps (two accumulator chains of 64 x 128 do not fit)")
    w_up, s_up = up if up is not None else (weight, scale)
    aligned = (x.stride(1) == 1 and x.stride(0) % 4 == 0 and weight.stride(2) == 1 and weight.stride(0) % 8 == 0
               and scale.stride(2) == 1 and scale.stride(0) % 4 == 0 and scale.stride(1) % 4 == 0
               and w_up.stride() == weight.stride() and s_up.stride() == scale.stride()
               and all(t.data_ptr() % 16 == 0 for t in (x, weight, scale, w_up, s_up)))
    if not aligned:  # the copies move 8 bytes of activations and weights, 4 of scales, at once
        raise ValueError("the Gluon grouped GEMM needs 16-byte aligned tensors with unit inner strides, activation "
                         "rows and expert weight stacks 8-byte aligned, scale rows 4-byte aligned, gate / up alike")
    if out is None:
        width = n_out * (2 if up is not None and split_k > 1 else 1)
        out = torch.empty(num_assign * split_k, width, dtype=out_dtype, device=x.device)
    kind, beta, linear_beta = act
    row_blocks = min(rows.numel() // block_m, num_assign)
    cols = 2 * BLOCK_N if warps == 8 and up is None else BLOCK_N  # output columns a program
    if cols_first is None:
        cols_first = COLS_FIRST_MIN_ROWS is not None and block_m >= COLS_FIRST_MIN_ROWS
    tiles = triton.cdiv(n_out, cols)
    cols_first = cols_first and row_blocks < 65536  # (the grid's second dimension)
    _grouped_gemm_kernel[(tiles, row_blocks, split_k) if cols_first else (row_blocks, tiles, split_k)](
        x, weight, scale, w_up, s_up, out, rows, block_expert, row_scale if row_scale is not None else out,
        num_assign, top_k, n_out, K, x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0),
        scale.stride(1), out.stride(0), float(beta), float(linear_beta or 1.0), static_expert0, GLU=up is not None,
        SITU=kind == "situ", LINEAR_CLIP=linear_beta is not None, HAS_ROW_SCALE=row_scale is not None,
        BLOCK_M=block_m, WARPS=warps, COLS_FIRST=cols_first, SPLIT_K=split_k,
        PREFETCH=prefetch and PREFETCH, STATIC_TAIL=static_tail, ACC_STORE=ACC_STORE,
        EARLY_ROWS=EARLY_ROWS, num_warps=warps,
        **({"maxnreg": maxnreg} if maxnreg else {}),
        **(pdl.launch(out.device) if PDL and (PDL_UNSPLIT_GLU or up is None or split_k > 1) else {}))
    return out

"""Grouped expert GEMM in Triton with MXFP4 weights dequantised in registers (W4A16; Hopper has
no FP4 tensor cores) or plain bf16 weights, and the MoE built on it.

Token-to-expert assignments are sorted by expert on the device and padded per expert to the row
block, so one launch covers every active expert: program (row block, column tile) multiplies its
block of gathered activation rows by its expert's weight tile. MXFP4 bytes (low nibble = even
input) are upcast to bf16 and scaled by 2^(E8M0 - 127) per 32 inputs inside the K loop, so only
4.25 bits per weight cross the memory bus. Two upcasts: tl.dot_scaled for bf16 activations, and an
exact fp32 decode for fp32 activations (the CPU tests' 1e-5 path). (A hand-written word-wide bit
upcast, "swar", was 1.3x slower at decode and 3x at prefill on the H200: RESULTS.md, sixth session.)

Reference: ``moe_ref.experts_ref``. Checked on CPU with ``TRITON_INTERPRET=1``
(tests/test_moe_triton.py); timed and swept on the H200 by bench/kernels_moe.py (RESULTS.md).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import norm_triton, pdl
from .autotune import autotuned, interpreted, sm_count
from .expert_sort import one_row_blocks, sort_by_expert, sort_by_expert_sizes
from .glu_triton import glu, glu_triton
from .mxfp4 import MMA_PAIR_TERMS
from .pdl import pdl_start
from .tickets import last_arrival, tickets


@triton.jit
def _e2m1(code):
    """E2M1 nibble -> fp32 by building the bits (no float math, no table): bit 3 is the sign; a
    magnitude code m >= 2 is 2^(m//2 - 1) * (1 + (m & 1) / 2), whose exponent and leading mantissa
    bits are exactly m << 22 on top of exponent 126; m == 1 is 0.5 (exponent 126), m == 0 zero."""
    m = code & 7
    bits = tl.where(m >= 2, (m << 22) + (126 << 23), tl.where(m == 1, 126 << 23, 0)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_group(X, W, S, tok, valid, e, cols, cmask, kk, stride_xt, stride_we, stride_wn, stride_se, stride_sn):
    """One 32-wide scale group at column kk: the partial product [BLOCK_M, BLOCK_N] in fp32.
    Byte j of a row packs k = 2j (low nibble) and 2j + 1 (high): rather than interleave the two
    nibble tiles (a register shuffle), the activations are split into even and odd columns and
    each half multiplies its own tile."""
    j = tl.arange(0, 16)
    packed = tl.load(W + e * stride_we + cols[:, None] * stride_wn + (kk // 2 + j)[None, :], mask=cmask[:, None],
                     other=0).to(tl.int32)
    sc = tl.load(S + e * stride_se + cols * stride_sn + kk // 32, mask=cmask, other=127)
    factor = tl.exp2(sc.to(tl.float32) - 127.0)[:, None]
    a_even = tl.load(X + tok[:, None] * stride_xt + (kk + 2 * j)[None, :], mask=valid[:, None], other=0.0)
    a_odd = tl.load(X + tok[:, None] * stride_xt + (kk + 2 * j + 1)[None, :], mask=valid[:, None], other=0.0)
    w_even = (_e2m1(packed & 15) * factor).to(a_even.dtype)
    w_odd = (_e2m1(packed >> 4) * factor).to(a_even.dtype)
    return tl.dot(a_even, tl.trans(w_even)).to(tl.float32) + tl.dot(a_odd, tl.trans(w_odd)).to(tl.float32)


# Four packed bytes -> their eight E2M1 codes as bf16, two per 32-bit register: the bytes are spread
# to the two halves (prmt, high bytes zero), each nibble's magnitude bits land at the bottom of the
# bf16 exponent (bits 6-8) and its sign at bit 15, which is the code's value times 2^-126 (the
# +/-0.5 codes subnormal), and one mul.bf16x2 by 2^126 makes it exact. Low nibbles: of the two
# shifted copies (magnitude, sign) each is zero where the other's bits belong, so one lop3,
# (a | b) & mask, joins them; high nibbles: the sign's copy also carries the low nibble's bit 0 to
# bit 8, so it is masked first. 2.5 instructions a code (20 for eight; the plain and / or form was
# 26). $0,$1: the low nibbles (even k) of bytes 0-3; $2,$3: the high nibbles (odd k); $4: the bytes.
# Checked by executing this text (tests/test_e2m1_ptx.py).
_E2M1_TO_BF16_ASM = tl.constexpr("""
{
.reg .b32 z, t0, t1, a, b, two126;
mov.b32 z, 0;
mov.b32 two126, 0x7E807E80;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
shl.b32 a, t0, 6; shl.b32 b, t0, 12; lop3.b32 a, a, b, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $0, a, two126;
shl.b32 a, t1, 6; shl.b32 b, t1, 12; lop3.b32 a, a, b, 0x81C081C0, 0xA8;
mul.rn.bf16x2 $1, a, two126;
shl.b32 a, t0, 2; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000; lop3.b32 a, a, b, 0x01C001C0, 0xEC;
mul.rn.bf16x2 $2, a, two126;
shl.b32 a, t1, 2; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000; lop3.b32 a, a, b, 0x01C001C0, 0xEC;
mul.rn.bf16x2 $3, a, two126;
}
""")


@triton.jit
def _e2m1_bytes_to_bf16(packed, INTERPRETED: tl.constexpr):
    """uint8 codes pairs -> (low nibble, high nibble) values, exact: bf16 from the PTX above on the
    GPU; fp32 from ``_e2m1`` under the interpreter (no inline PTX there, and its bf16 dot is inexact)."""
    if INTERPRETED:
        lo = _e2m1(packed.to(tl.int32) & 15)
        hi = _e2m1(packed.to(tl.int32) >> 4)
    else:
        lo, hi = tl.inline_asm_elementwise(_E2M1_TO_BF16_ASM, "=r,=r,=r,=r,r", [packed],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def _mx_group_asm(X, W, S, tok, valid, e, cols, cmask, kk, stride_xt, stride_we, stride_wn, stride_se, stride_sn,
                  SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr):
    """One 32-wide scale group at column kk, the codes upcast by ``_e2m1_bytes_to_bf16`` and put
    back in k order (join + reshape: each thread's bytes stay its own), one MMA, and the E8M0
    scale applied to the [rows x BLOCK_N] partial rather than to every weight (one multiply per
    output per 32 codes). Returns the scaled partial, [BLOCK_N, rows] with SWAP_AB."""
    j = tl.arange(0, 16)
    packed = tl.load(W + e * stride_we + cols[:, None] * stride_wn + (kk // 2 + j)[None, :], mask=cmask[:, None],
                     other=0)
    lo, hi = _e2m1_bytes_to_bf16(packed, INTERPRETED)
    w = tl.join(lo, hi).reshape(BLOCK_N, 32)
    a = tl.load(X + tok[:, None] * stride_xt + (kk + tl.arange(0, 32))[None, :], mask=valid[:, None], other=0.0)
    factor = tl.exp2(tl.load(S + e * stride_se + cols * stride_sn + kk // 32, mask=cmask, other=127).to(tl.float32)
                     - 127.0)
    a = a.to(w.dtype)
    if SWAP_AB:
        part = tl.dot(w, tl.trans(a)).to(tl.float32) * factor[:, None]
    else:
        part = tl.dot(a, tl.trans(w)).to(tl.float32) * factor[None, :]
    return part


# One 32-bit word of the MMA layout (``mxfp4.to_mma_layout``: four bytes' codes with their bits
# pre-arranged) -> its eight codes as four bf16x2 registers, each one byte's (low, high) nibble pair,
# i.e. an MMA operand pair (k, k + 1): register i is the OR of ``mxfp4.MMA_PAIR_TERMS[i]`` (the word
# rotated, masked; a rotation whose kept bits do not wrap is a plain shift), so the layout and this
# text come from one table; as in ``_E2M1_TO_BF16_ASM`` each masked pair is the codes' values times
# 2^-126 (the +/-0.5 codes subnormal), made exact by one mul.bf16x2 by 2^126 (moe_gluon replaces it
# by the block's scale). $0..$3: bytes 0..3; $4: the word. Checked by executing this text
# (tests/test_e2m1_ptx.py).


def _masked_rotation_ptx(reg: str, r: int, m: int) -> str:
    kept = [t for t in range(32) if m >> t & 1]
    if r == 0:
        return f"and.b32 {reg}, $4, 0x{m:08X};"
    if all(t >= r for t in kept):
        shift = f"shl.b32 {reg}, $4, {r};"
    elif all(t < r for t in kept):
        shift = f"shr.b32 {reg}, $4, {32 - r};"
    else:
        shift = f"shf.l.wrap.b32 {reg}, $4, $4, {r};"
    return f"{shift} and.b32 {reg}, {reg}, 0x{m:08X};"


def _word_upcast_ptx() -> str:
    lines = ["{", ".reg .b32 a, b, two126;", "mov.b32 two126, 0x7E807E80;"]
    for i, terms in enumerate(MMA_PAIR_TERMS):
        lines += [_masked_rotation_ptx(reg, r, m) for reg, (r, m) in zip("ab", terms)]
        lines += ["or.b32 a, a, b;"] * (len(terms) - 1) + [f"mul.rn.bf16x2 ${i}, a, two126;"]
    return "\n".join(lines + ["}"]) + "\n"


assert all(len(terms) <= 2 for terms in MMA_PAIR_TERMS)
_E2M1_WORD_TO_BF16_ASM = tl.constexpr(_word_upcast_ptx())
_PAIR_TERMS = tl.constexpr(MMA_PAIR_TERMS)


@triton.jit
def _half_value(reg, HIGH: tl.constexpr):
    """A bf16 half of an emulated register (the code's value times 2^-126) -> the value in fp32."""
    bits = (reg >> 16) & 0xFFFF if HIGH else reg & 0xFFFF
    return (bits << 16).to(tl.float32, bitcast=True) * 8.507059173023462e37  # 2^126


@triton.jit
def _mma_words_to_values(packed, INTERPRETED: tl.constexpr):
    """uint8 [..., 32, 8] of the MMA layout (lane, then k slice s = byte // 4 and word byte
    p = byte % 4) -> two tensors of that shape: output o at byte position (s, p) holds nibble p % 2
    of word byte 2 o + p // 2, which is the element (row 8 (p // 2) + g, k 16 s + 8 o + 2 c + p % 2)
    of the 16-row block. bf16 from ``_E2M1_WORD_TO_BF16_ASM`` (pack = 4: one word a call); under
    the interpreter its arithmetic in fp32 and integer ops. A pack is four consecutive registers of
    the operand's layout, which is one stored word only while each lane's bytes sit in registers in
    memory order: the order Triton derives back from the MMA operand through the permute in
    ``_mma_weight_group`` (k + 1, then row + 8: byte + 1, byte + 2). A scale or any other operand
    with a layout of its own can change it (twelfth session); gpu_check_kernels.py would decode
    garbage then."""
    if INTERPRETED:
        b = packed.to(tl.uint32).reshape(packed.shape[:-1] + [2, 4])
        word = tl.sum(b << (8 * tl.arange(0, 4).to(tl.uint32)), len(b.shape) - 1)  # bytes are disjoint bits
        regs = []
        for terms in _PAIR_TERMS.value:  # (the interpreter runs this loop in Python)
            reg = word & 0
            for r, m in terms:
                reg = reg | (((word << r) | (word >> (32 - r))) & m if r else word & m)
            regs.append(reg)
        r0, r1, r2, r3 = regs
        # output o at byte position p = 2 q1 + q0: half q0 of register 2 o + q1; dims (s, q0, q1) -> (s, q1, q0)
        out0 = tl.join(tl.join(_half_value(r0, False), _half_value(r0, True)),
                       tl.join(_half_value(r1, False), _half_value(r1, True)))
        out1 = tl.join(tl.join(_half_value(r2, False), _half_value(r2, True)),
                       tl.join(_half_value(r3, False), _half_value(r3, True)))
        d: tl.constexpr = len(out0.shape)
        order: tl.constexpr = list(range(d - 2)) + [d - 1, d - 2]
        out0 = out0.permute(order).reshape(packed.shape)
        out1 = out1.permute(order).reshape(packed.shape)
    else:
        out0, out1 = tl.inline_asm_elementwise(_E2M1_WORD_TO_BF16_ASM, "=r,=r,=r,=r,r", [packed],
                                               dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    return out0, out1


@triton.jit
def _mma_weight_group(W, e, pid_n, kk, N, stride_we, stride_wn, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The unscaled bf16 weight tile [BLOCK_N, 32] of the 32-code group at kk, from weights in the
    MMA layout: each lane loads its 8 bytes of a 16-row block as one vector, the upcast leaves the
    MMA's (k, k + 1) pairs in whole registers, and the reshapes / permute below only rename
    registers into the tile's order (the operand layout the MMA wants from registers): no
    shared-memory round trip, no byte shuffles (bench/sass_mix.py, Triton 3.6 and 3.9)."""
    NB: tl.constexpr = BLOCK_N // 16
    blk = pid_n * NB + tl.arange(0, NB)
    offs = (blk * 16 * stride_wn + (kk // 32) * 256)[:, None, None] + (tl.arange(0, 32) * 8)[None, :, None] \
        + tl.arange(0, 8)[None, None, :]
    packed = tl.load(W + e * stride_we + offs, mask=(blk * 16 < N)[:, None, None], other=0)  # [blk, lane, 8]
    out0, out1 = _mma_words_to_values(packed, INTERPRETED)
    w = tl.join(out0, out1).reshape(NB, 8, 4, 2, 2, 2, 2)  # blk, g, c, s, h, q0, o
    return w.permute(0, 4, 1, 3, 6, 2, 5).reshape(BLOCK_N, 32)  # rows (blk, h, g); k (s, o, c, q0)


@triton.jit
def _mma_group_partial(W, S, a, e, pid_n, cols, cmask, kk, N, stride_we, stride_wn, stride_se, stride_sn,
                       SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the unscaled product of the group at kk with the activation tile ``a``, in a fresh
    accumulator; the rows' E8M0 factors, shaped to scale it)."""
    w = _mma_weight_group(W, e, pid_n, kk, N, stride_we, stride_wn, INTERPRETED, BLOCK_N)
    a = a.to(w.dtype)
    # 2^(E8M0 - 127) from the bits: exact but for byte 0 (2^-127, a subnormal), which gives 0; an
    # all-zero block is stored with it (``mxfp4.quantize_mxfp4``) and nothing else that small matters
    sc = tl.load(S + e * stride_se + cols * stride_sn + kk // 32, mask=cmask, other=127).to(tl.int32)
    f = (sc << 23).to(tl.float32, bitcast=True)
    if SWAP_AB:
        return tl.dot(w, tl.trans(a)), f[:, None]
    else:
        return tl.dot(a, tl.trans(w)), f[None, :]


@triton.jit
def _mx_tile_mma(acc, acc_up, X, W, S, W_UP, S_UP, tok, valid, e, pid_n, cols, cmask, k0, N, stride_xt, stride_we,
                 stride_wn, stride_se, stride_sn, GLU: tl.constexpr, SWAP_AB: tl.constexpr,
                 INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(acc, acc_up) + the K tile's products for weights in the MMA layout: per 32-code group, one
    activation load serves the gate's and the up's MMAs, each into a fresh accumulator, then each
    is scaled by its rows' E8M0 factors into its sum with one FMA an output. (Triton 3.6 waits
    for each register-operand wgmma right after issuing it; ncu: 65 % SM throughput at 5-7
    programs an SM, latency and issue together.) (A wgmma accumulator carried across groups or the K loop, with
    the weights as its register operand, makes ptxas serialise every wgmma: the loop's zero-trip
    path defines it with other instructions, C7515. And the scale folded into the upcast's
    multiply needs its own register layout, which Triton 3.6 then imposes on the weights: a
    shared-memory round trip. Both measured on CPU with bench/sass_mix.py, twelfth session.)"""
    for g in tl.static_range(BLOCK_K // 32):
        kk = k0 + 32 * g
        a = tl.load(X + tok[:, None] * stride_xt + (kk + tl.arange(0, 32))[None, :], mask=valid[:, None], other=0.0)
        part, f = _mma_group_partial(W, S, a, e, pid_n, cols, cmask, kk, N, stride_we, stride_wn, stride_se,
                                     stride_sn, SWAP_AB, INTERPRETED, BLOCK_N)
        if GLU:
            part_up, f_up = _mma_group_partial(W_UP, S_UP, a, e, pid_n, cols, cmask, kk, N, stride_we, stride_wn,
                                               stride_se, stride_sn, SWAP_AB, INTERPRETED, BLOCK_N)
            acc_up += part_up * f_up
        acc += part * f
    return acc, acc_up


@triton.jit
def _weight_tile_product(a, W, S, e, cols, cmask, k0, stride_we, stride_wn, stride_se, stride_sn, acc,
                         MXFP4: tl.constexpr, SWAP_AB: tl.constexpr, BLOCK_K: tl.constexpr,
                         INTERPRETED: tl.constexpr):
    """acc + a @ W[e][cols, k0:k0+BLOCK_K]^T (or its transpose with SWAP_AB). MXFP4 goes through
    tl.dot_scaled: Triton upcasts the E2M1 codes and E8M0 scales to bf16 in registers on Hopper
    (no FP4 tensor cores) with its own conversion, far fewer instructions than a decode written
    here, and the packed tile is loaded [cols, BLOCK_K / 2] straight from the checkpoint layout.
    SWAP_AB computes W @ a^T: the weight tile becomes the M side of the MMA, so a decode step's
    handful of rows per expert sits on the small N side instead of padding M to 16 or 64. Under
    the interpreter bf16 tiles are multiplied in fp32 (its bf16 dot returns garbage)."""
    if MXFP4:
        kh = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        w = tl.load(W + e * stride_we + cols[:, None] * stride_wn + kh[None, :], mask=cmask[:, None], other=0)
        s = tl.load(S + e * stride_se + cols[:, None] * stride_sn + ks[None, :], mask=cmask[:, None], other=127)
        if SWAP_AB:  # (one return per path: Triton 3.6 also traces a return after a taken constexpr if)
            acc = tl.dot_scaled(w, s, "e2m1", tl.trans(a), None, "bf16", acc=acc)
        else:
            acc = tl.dot_scaled(a, None, "bf16", tl.trans(w), s, "e2m1", acc=acc)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(W + e * stride_we + cols[:, None] * stride_wn + kk[None, :], mask=cmask[:, None], other=0.0)
        w = w.to(a.dtype)
        if INTERPRETED:
            w, a = w.to(tl.float32), a.to(tl.float32)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc)
        else:
            acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit
def _grouped_gemm_kernel(
    X, W, S, W_UP, S_UP, OUT, ROWS, EXPERTS, ROW_SCALE,
    num_assign, rows_class, top_k, N, K,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_on, beta, linear_beta, static_expert0,
    WEIGHTS: tl.constexpr, GLU: tl.constexpr, SITU: tl.constexpr, LINEAR_CLIP: tl.constexpr,
    HAS_ROW_SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, INTERPRETED: tl.constexpr, COLS_FIRST: tl.constexpr = False,
    STATIC_TAIL: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    """out = x_rows @ W[e]^T, or with GLU: act(x_rows @ W[e]^T, x_rows @ W_UP[e]^T) fused in the
    epilogue (SiLU-GLU, or SiTU-GLU with its tanh clips). WEIGHTS: "bf16"; or MXFP4 upcast in
    registers, for bf16 activations by tl.dot_scaled ("mx_dot_scaled") or by our PTX bit upcast
    with the scale on the partial products ("mx_asm"), for fp32 activations decoded here one
    32-wide scale group at a time ("mx_decode": the exact path the CPU tests hold to 1e-5).
    ``rows_class`` only keys the autotuner (a batch-1 step and a batch-64 step want different
    tiles). (A K split over programs for one- and two-token steps, and the combine with the
    residual add + norm as this kernel's tail, both lost on the H200: RESULTS.md ninth session.)
    STATIC_TAIL: the last row blocks (one assignment each: a one-token step's joined shared
    experts) have the constant experts static_expert0, static_expert0 + 1, ...: they need nothing
    the previous kernels wrote but x, so they run their K loop before the PDL wait (during the
    routing that the other blocks wait for) and wait only to store (the output buffer may be
    memory the previous kernel still reads)."""
    pid_m = tl.program_id(1 if COLS_FIRST else 0)  # (COLS_FIRST: ``TRITON_COLS_FIRST_MIN_ROWS``)
    pid_n = tl.program_id(0 if COLS_FIRST else 1)
    if STATIC_TAIL:
        first_static = tl.num_programs(1 if COLS_FIRST else 0) - STATIC_TAIL
        static = pid_m >= first_static
        if static:
            if USE_PDL:
                tl.extra.cuda.gdc_launch_dependents()
        else:
            pdl_start(USE_PDL)
        e = tl.where(static, static_expert0 + pid_m - first_static,
                     tl.load(EXPERTS + pid_m, mask=not static, other=0)).to(tl.int64)
    else:
        pdl_start(USE_PDL)
        e = tl.load(EXPERTS + pid_m).to(tl.int64)
    rows = tl.load(ROWS + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_assign
    tok = tl.where(valid, rows // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # The grid may still hold blocks of padding only (a batch whose experts each get a few rows);
    # valid rows lead each block, so its first row says whether any is valid. An empty block skips
    # the K loop: it must not stream its expert's weights.
    k_end = tl.where(tl.load(ROWS + pid_m * BLOCK_M) < num_assign, K, 0)
    for k0 in range(0, k_end, BLOCK_K):
        if WEIGHTS == "mx_mma":
            acc, acc_up = _mx_tile_mma(acc, acc_up, X, W, S, W_UP, S_UP, tok, valid, e, pid_n, cols, cmask, k0, N,
                                       stride_xt, stride_we, stride_wn, stride_se, stride_sn, GLU, SWAP_AB,
                                       INTERPRETED, BLOCK_N, BLOCK_K)
        elif WEIGHTS == "mx_asm":
            for g in tl.static_range(BLOCK_K // 32):
                acc += _mx_group_asm(X, W, S, tok, valid, e, cols, cmask, k0 + 32 * g, stride_xt, stride_we,
                                     stride_wn, stride_se, stride_sn, SWAP_AB, INTERPRETED, BLOCK_N)
                if GLU:
                    acc_up += _mx_group_asm(X, W_UP, S_UP, tok, valid, e, cols, cmask, k0 + 32 * g, stride_xt,
                                            stride_we, stride_wn, stride_se, stride_sn, SWAP_AB, INTERPRETED, BLOCK_N)
        elif WEIGHTS == "mx_decode":
            for g in tl.static_range(BLOCK_K // 32):
                part = _mx_group(X, W, S, tok, valid, e, cols, cmask, k0 + 32 * g, stride_xt, stride_we, stride_wn,
                                 stride_se, stride_sn)
                acc += tl.trans(part) if SWAP_AB else part
                if GLU:
                    part = _mx_group(X, W_UP, S_UP, tok, valid, e, cols, cmask, k0 + 32 * g, stride_xt, stride_we,
                                     stride_wn, stride_se, stride_sn)
                    acc_up += tl.trans(part) if SWAP_AB else part
        else:
            a = tl.load(X + tok[:, None] * stride_xt + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None],
                        other=0.0)
            acc = _weight_tile_product(a, W, S, e, cols, cmask, k0, stride_we, stride_wn, stride_se, stride_sn, acc,
                                       WEIGHTS == "mx_dot_scaled", SWAP_AB, BLOCK_K, INTERPRETED)
            if GLU:
                acc_up = _weight_tile_product(a, W_UP, S_UP, e, cols, cmask, k0, stride_we, stride_wn, stride_se,
                                              stride_sn, acc_up, WEIGHTS == "mx_dot_scaled", SWAP_AB, BLOCK_K,
                                              INTERPRETED)
    if GLU:
        acc = glu(acc, acc_up, beta, linear_beta, SITU, LINEAR_CLIP, False)
    if SWAP_AB:
        acc = tl.trans(acc)
    if HAS_ROW_SCALE:  # the routing weight of each assignment, applied in the epilogue
        acc = acc * tl.load(ROW_SCALE + tl.where(valid, rows, 0), mask=valid, other=0.0)[:, None]
    if STATIC_TAIL:
        if static:
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
    tl.store(OUT + rows[:, None] * stride_on + cols[None, :], acc.to(OUT.dtype.element_ty),
             mask=valid[:, None] & cmask[None, :])


# Tile width, orientation and pipelining, picked on the GPU at first use of each shape (~1 s a
# config to compile): the winners of bench/kernels_moe.py's sweep on the H200 (RESULTS.md, fifth
# session). MXFP4 decode: 64 wide, 4 warps, 3 stages (K3's 16 to 64 tokens); 32 wide, 2 warps,
# swapped (1 token). MXFP4 prefill: 128 wide, 8 warps (row blocks of 128). bf16 decode: any of
# them is within a few % at 16-64 tokens.
# Our E2M1 upcast ("mx_asm", decode row blocks only) is tuned over the tiles it was checked and timed
# with on the H200 (seventh session: 128 wide, swapped, 4 warps won at 16 and 64 tokens); the others
# over the original five.
# The MMA-layout upcast ("mx_mma") takes swapped tiles only (the weights are the register operand)
# with BLOCK_N a multiple of 16 rows a warp, and whole warpgroups: with 2 warps (mma.sync) Triton
# sends the tile through shared memory, 0.33 ms at 1 token against 0.18 (twelfth session). Two
# stages beat three at decode (71 registers and 16 KB a program: 7 programs an SM instead of 5).
# (64, True, 4, 4): the one-token down projection (K = 1024) inside the decode step's PDL chain,
# where the tile the autotuner picks alone (32, False, 4, 3) lost 1.9 us a layer (RESULTS.md
# twenty-third session: an A/B of the graph-replayed step, each kernel's share of its critical path).
# (32, True, 2, 3) and (64, True, 4, 3): the one-token gate/up and down with K tiles of 128
# (``BF16_WIDE_K_MAX_ROWS``), picked the same way (twenty-fourth session).
_TILES = {(64, False, 4, 3), (32, False, 4, 3), (32, True, 2, 4), (128, False, 8, 3), (128, False, 4, 4),
          (64, True, 4, 4), (32, True, 2, 3), (64, True, 4, 3)}
_ASM_TILES = {(64, False, 4, 3), (32, True, 2, 4), (128, True, 4, 3)}
_MMA_TILES = {(64, True, 4, 2), (64, True, 4, 3), (128, True, 4, 2), (128, True, 8, 2), (128, True, 8, 3)}
# bf16 prefill (rows classes from ``PREFILL_TILES_MIN_ROWS``) also tries a 4-stage 128-wide tile and a 256-wide one
# (the latter fits shared memory without the GLU's second weight tile: the down projection). Kimi-Linear at 8K
# tokens, row blocks of 128, alone on the H200: gate / up 1.290 ms (128, 8 warps, 4 stages) against 1.379 (3
# stages); down 0.800 (256 wide) against 0.816-0.937 (RESULTS.md thirty-ninth session).
_PREFILL_TILES = {(128, False, 8, 4), (256, False, 8, 3)}
PREFILL_TILES_MIN_ROWS = 4096
GROUPED_GEMM_CONFIGS = [triton.Config({"BLOCK_N": bn, "SWAP_AB": swap}, num_warps=w, num_stages=st)
                        for bn, swap, w, st in sorted(_TILES | _ASM_TILES | _MMA_TILES | _PREFILL_TILES)]


def _tiles_for_weights(configs, named_args, **kwargs):
    weights = kwargs.get("WEIGHTS", named_args.get("WEIGHTS"))
    keep = {"mx_asm": _ASM_TILES, "mx_mma": _MMA_TILES}.get(weights, _TILES)
    if weights == "bf16" and kwargs.get("rows_class", named_args.get("rows_class", 0)) >= PREFILL_TILES_MIN_ROWS:
        keep = keep | _PREFILL_TILES
    return [c for c in configs if (c.kwargs["BLOCK_N"], c.kwargs["SWAP_AB"], c.num_warps, c.num_stages) in keep] \
        or configs[:1]


_grouped_gemm_tuned = autotuned(
    _grouped_gemm_kernel, GROUPED_GEMM_CONFIGS,
    triton.Config({"BLOCK_N": 32, "SWAP_AB": False}, num_warps=4, num_stages=1),
    key=["N", "K", "WEIGHTS", "GLU", "BLOCK_M", "BLOCK_K", "rows_class"], prune=_tiles_for_weights)


@triton.jit
def _route_kernel(LOGITS, BIAS, W_OUT, ID_OUT, num_parts, stride_part, stride_l, E, scaling,
                  K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                  RENORM: tl.constexpr, SIGMOID: tl.constexpr, NUM_SHARED: tl.constexpr,
                  STATIC_PARTS: tl.constexpr = 0, USE_PDL: tl.constexpr = False):
    """One token's routing (``moe_ref.route`` with one expert group): logits as the sum of
    ``num_parts`` partial sums (``router_logits(split=True)``; 1 for plain logits), scores,
    bias-corrected choice, top-k by K rounds of a packed max (descending, as torch.topk), weights
    from the unbiased scores, renormalised, scaled; then NUM_SHARED always-on experts E, E + 1, ...
    of weight 1."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P)
    live = e < E
    logit = tl.zeros([E_P], tl.float32)
    row = LOGITS + t * stride_l + e
    if STATIC_PARTS:  # unrolled: every part's load in flight at once
        for part in tl.static_range(STATIC_PARTS):
            logit += tl.load(row + part * stride_part, mask=live, other=0.0).to(tl.float32)
    else:
        for part in range(num_parts):  # a fixed order: the same logits every run
            logit += tl.load(row + part * stride_part, mask=live, other=0.0).to(tl.float32)
    logit = tl.where(live, logit, float("-inf"))
    if SIGMOID:
        score = tl.sigmoid(logit)
    else:
        p = tl.exp(logit - tl.max(logit, 0))
        score = p / tl.sum(p, 0)
    choice = score
    if HAS_BIAS:
        choice = choice + tl.load(BIAS + e, mask=live, other=0.0).to(tl.float32)
    # NaN scores (an overflowed activation) are never chosen, so every id stays a real expert
    # (ids index the expert weights and the sort's cursors: a bad one would read or write wild memory).
    choice = tl.where(live & (choice == choice), choice, float("-inf"))
    ks = tl.arange(0, K_P)
    ids = tl.zeros([K_P], tl.int32)
    # One int64 max a round: the choice's bits made order-preserving as a signed int (negative
    # floats get their magnitude bits flipped) in the high word, the expert reversed in the low one
    # (ties go to the lower id); the scores of the K winners gathered after. (An argmax and a masked
    # sum a round, two reductions, took 3.99 / 3.81 us a call at batch 1 / 16 against 3.73 / 3.49 on
    # the H200: RESULTS.md twenty-third session.)
    bits = choice.to(tl.int32, bitcast=True)
    order = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    key = tl.where(live, order * 4294967296 + (E_P - 1 - e), -9223372036854775807)
    for j in tl.static_range(K):
        best_key = tl.max(key, 0)
        ids = tl.where(ks == j, (E_P - 1 - (best_key & 0xFFFFFFFF)).to(tl.int32), ids)
        key = tl.where(key == best_key, -9223372036854775807, key)
    ws = tl.where(ks < K, tl.gather(score, ids, 0), 0.0)  # (K_P > K: the padding weighs nothing)
    if RENORM:
        ws = ws / (tl.sum(ws, 0) + 1e-20)
    row = t * (K + NUM_SHARED)
    tl.store(W_OUT + row + ks, ws * scaling, mask=ks < K)
    tl.store(ID_OUT + row + ks, ids.to(tl.int64), mask=ks < K)
    for s in tl.static_range(NUM_SHARED):
        tl.store(W_OUT + row + K + s, 1.0)
        tl.store(ID_OUT + row + K + s, (E + s).to(tl.int64))


@triton.jit
def _router_logits_kernel(X, W, OUT, T, E, D, stride_x, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_D: tl.constexpr, BF16_MMA: tl.constexpr, PRELOAD: tl.constexpr = False,
                          USE_PDL: tl.constexpr = False):
    """Program (expert block, D chunk, token block): the partial logits of one BLOCK_D-wide chunk,
    OUT[chunk, t, e] = x[t, chunk] . W[e, chunk], in fp32. bf16 x and W go through the tensor
    cores: a product of two bf16 values is exact in fp32 and the MMA accumulates in fp32, so this
    is the fp32 product of the casts up to summation order. Other dtypes: IEEE fp32 (no TF32).
    PRELOAD: the (model) weight tile is read before the wait on the previous kernel."""
    if not PRELOAD:
        pdl_start(USE_PDL)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    chunk = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    tmask, emask, dmask = t < T, e < E, d < D
    w = tl.load(W + e.to(tl.int64)[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
    if PRELOAD:
        pdl_start(USE_PDL)
    x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + d[None, :], mask=tmask[:, None] & dmask[None, :], other=0.0)
    if BF16_MMA:
        acc = tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    else:
        acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    tl.store(OUT + (chunk * T + t.to(tl.int64))[:, None] * E + e[None, :], acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _router_gemm_kernel(X, W, OUT, T, E, D, stride_x, one, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_D: tl.constexpr, BF16_MMA: tl.constexpr):
    """Program (expert block, token block): OUT[t, e] = x[t] . W[e] in fp32 over all of D, each
    BLOCK_D chunk's product from the tensor cores with a fresh accumulator and the chunks summed in
    fp32 registers, as decode's partial sums are: a chunk's bf16 products are exact in fp32 and its
    MMA sums 128 of them (decode's rows: 1-3e-7 from float64), where one MMA accumulator over the
    whole width (cuBLAS's fp32-output GEMM) drifted to 2.4e-6 at D 2304. ``one`` (1.0, a runtime
    value) keeps the compiler from folding the chunk sums back into the MMA accumulator."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # expert blocks fastest: they share x's rows in L2
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask, emask = t < T, e < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for k in range(0, D, BLOCK_D):
        d = k + tl.arange(0, BLOCK_D)
        x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + d[None, :], mask=tmask[:, None] & (d < D)[None, :],
                    other=0.0)
        w = tl.load(W + e.to(tl.int64)[:, None] * D + d[None, :], mask=emask[:, None] & (d < D)[None, :], other=0.0)
        if BF16_MMA:
            part = tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        else:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        acc += part * one
    tl.store(OUT + t.to(tl.int64)[:, None] * E + e[None, :], acc, mask=tmask[:, None] & emask[None, :])


ROUTER_GEMM_CONFIGS = [triton.Config({"BLOCK_T": bt, "BLOCK_E": be, "BLOCK_D": bd}, num_warps=w, num_stages=st)
                       for bt, be, bd, w, st in ((128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (128, 64, 128, 4, 3),
                                                 (64, 64, 128, 4, 3), (128, 128, 128, 8, 2))]
# Keyed on the router's shape only: a prefill's token count changes every step.
_router_gemm_tuned = autotuned(_router_gemm_kernel, ROUTER_GEMM_CONFIGS,
                               triton.Config({"BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_D": 32}), key=["E", "D"])


def router_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits x W^T [T, E] for x [T, D] (rows may be strided, dense last dim) and a dense
    router weight [E, D], in one launch (``_router_gemm_kernel``)."""
    T, D = x.shape
    E = weight.shape[0]
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    if T:
        bf16 = x.dtype == weight.dtype == torch.bfloat16 and not interpreted()
        grid = lambda meta: (triton.cdiv(E, meta["BLOCK_E"]), triton.cdiv(T, meta["BLOCK_T"]))  # noqa: E731
        _router_gemm_tuned[grid](x, weight, out, T, E, D, x.stride(0), 1.0, BF16_MMA=bf16)
    return out


# Up to this many tokens the router's logits come from one Triton launch that reads x and the
# weight in the model dtype (a decode step); past it, one GEMM for the whole batch.
ROUTER_KERNEL_MAX_TOKENS = 64
# That GEMM from ``router_gemm`` (bf16 tensor cores, chunk sums in fp32 registers: fp32 precision
# without upcasting x or running fp32 FFMA) instead of cuBLAS's fp32 GEMM of the upcasts: 8,192
# tokens on the H200 0.267 -> 0.030 ms (kimi-linear-48b), 2.28 -> 0.29 ms (K3), 1.3e-7 / 2.0e-7 from
# the float64 logits (the fp32 GEMM 2.7e-7 / 2.4e-7; RESULTS.md seventeenth session).
ROUTER_PREFILL_KERNEL = True


# Prefill's router GEMM from bf16 inputs on the tensor cores with fp32 output (``mm``'s
# ``out_dtype``, torch >= 2.8), the form of K3's reference code (model-spec, implementation note 13),
# instead of HF's fp32 GEMM of upcast inputs. 8,192 tokens on an H200: 0.27 -> 0.020 ms
# (kimi-linear-48b, E 256, D 2304), 2.28 -> 0.16 ms (K3, E 896, D 7168), but 2.4e-6 / 7.9e-6 from
# the float64 logits where the fp32 GEMM (and decode's router kernel) stays under 1e-6: the tensor
# cores' fp32 accumulation over the full width is not IEEE fp32 summation, and expert choices can
# differ on near-ties. Off: the spec prefers full fp32 (determinism checks); an opt-in for speed.
ROUTER_PREFILL_MMA = False


def _logits_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 x W^T: HF's fp32 GEMM of the upcasts, or where ``ROUTER_PREFILL_MMA`` (bf16 / fp16
    operands on the GPU) cuBLAS's fp32-output GEMM, or where ``ROUTER_PREFILL_KERNEL`` ours."""
    if ROUTER_PREFILL_MMA and x.is_cuda and x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16):
        try:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        except TypeError:  # torch < 2.8: no out_dtype
            pass
    if ROUTER_PREFILL_KERNEL and (x.is_cuda or interpreted()) and x.stride(-1) == 1 and weight.is_contiguous():
        return router_gemm(x, weight)
    return F.linear(x.float(), weight.float())


# The router weight's tile read before the PDL wait (``_router_logits_kernel``'s PRELOAD): the kernel
# follows a short one (the add + RMSNorm), which its 1.2 MB of weight reads now overlap: 2.2 -> 1.1 us
# a call on the H200, -0.029 ms a kimi-linear batch-1 step (RESULTS.md twenty-third session).
# (The same for the GEMVs' first weight tile and the fused KDA step's first state tile lost: the
# tile needs a pipeline stage's shared memory or holds registers across the convs.)
ROUTER_PRELOAD = True


def router_chunks(D: int) -> tuple[int, int]:
    """(chunk width, chunks) of the router's partial logits over D: one layout for every kernel
    that writes them (``router_logits``, ``add_norm_router_logits``) and the route kernel's sum."""
    block_d = 128 if D <= 4096 else 256
    return block_d, triton.cdiv(D, block_d)


def router_logits(x: torch.Tensor, weight: torch.Tensor, split: bool = False) -> torch.Tensor:
    """F.linear(x.float(), weight.float()) for a router weight [E, D] (a model weight, not written
    by the step: ``ROUTER_PRELOAD`` reads it before the wait on the previous kernel): fp32 logits [T, E]; with
    ``split``, decode-sized batches return the partial sums over chunks of D instead, [S, T, E]
    (S >= 1), which ``route_triton`` adds up. The split spreads a decode step's GEMV over ~150
    programs (one program per 32 experts over all of D took 85 us a layer on kimi-linear's
    1.2 MB weight, RESULTS.md seventh session) without atomics: same logits every run."""
    T, D = x.shape
    E = weight.shape[0]
    if T > ROUTER_KERNEL_MAX_TOKENS or x.stride(-1) != 1 or not weight.is_contiguous():
        logits = _logits_gemm(x, weight)
        return logits[None] if split else logits
    block_d, parts = router_chunks(D)
    out = torch.empty(parts, T, E, dtype=torch.float32, device=x.device)
    if T:
        bf16 = x.dtype == weight.dtype == torch.bfloat16 and not interpreted()  # (the interpreter's bf16 dot is not exact)
        _router_logits_kernel[(triton.cdiv(E, 32), parts, triton.cdiv(T, 16))](
            x, weight, out, T, E, D, x.stride(0), BLOCK_T=16, BLOCK_E=32, BLOCK_D=block_d, BF16_MMA=bf16,
            PRELOAD=ROUTER_PRELOAD, **pdl.launch(out.device))
    return out if split else out.sum(0)


@triton.jit
def _add_norm_router_kernel(H, DELTA, NORM_W, W, H_OUT, Y, OUT, T, E, D, stride_h, stride_d, stride_ho, stride_y,
                            eps, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr,
                            USE_PDL: tl.constexpr = False):
    """Program (expert block, D chunk, token): norm_triton's add + RMSNorm of the token's row, then
    the router's partial logits over the chunk, OUT[chunk, t, e] (``_router_logits_kernel``'s
    layout). Every program adds and normalises the whole row itself (two L2 reads of the row), so
    no launch sits between the residual add + norm and the router; the programs of expert block 0
    write their chunk of h + delta and of the norm for the layers after. The weight tiles are read
    before the PDL wait."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    chunk = tl.program_id(1)
    t = tl.program_id(2).to(tl.int64)
    d = chunk * BLOCK_D + tl.arange(0, BLOCK_D)
    emask, dmask = e < E, d < D
    w = tl.load(W + e.to(tl.int64)[:, None] * D + d[None, :], mask=emask[:, None] & dmask[None, :], other=0.0)
    norm_w = tl.load(NORM_W + d, mask=dmask, other=0.0).to(tl.float32)
    pdl_start(USE_PDL)
    cols = tl.arange(0, BLOCK)
    dtype = H_OUT.dtype.element_ty
    row = norm_triton.residual_sum(H, DELTA, t, stride_h, stride_d, cols, cols < D, dtype).to(tl.float32)
    s = norm_triton.residual_sum(H, DELTA, t, stride_h, stride_d, d, dmask, dtype)
    y = (s.to(tl.float32) / norm_triton.rms(row, D, eps) * norm_w).to(Y.dtype.element_ty)
    if tl.program_id(0) == 0:
        tl.store(H_OUT + t * stride_ho + d, s, mask=dmask)
        tl.store(Y + t * stride_y + d, y, mask=dmask)
    logits = tl.sum(w.to(tl.float32) * y.to(tl.float32)[None, :], 1)  # exact products, fp32 sums
    tl.store(OUT + (chunk * T + t) * E + e, logits, mask=emask)


# The residual add + RMSNorm before a MoE layer and its router logits in one launch
# (``add_norm_router_logits``) for up to this many tokens; False: two launches (A/B timing).
ADD_NORM_ROUTER = True
ADD_NORM_ROUTER_MAX_TOKENS = 4


def add_norm_router_applies(h: torch.Tensor, delta: torch.Tensor, router_weight: torch.Tensor) -> bool:
    """Whether ``add_norm_router_logits`` takes these: a few tokens of dense rows, one dtype."""
    return (ADD_NORM_ROUTER and h.dim() == 2 and h.shape[0] <= ADD_NORM_ROUTER_MAX_TOKENS and h.dtype == delta.dtype
            and h.stride(-1) == 1 and delta.stride(-1) == 1 and router_weight.is_contiguous()
            and router_weight.shape[1] == h.shape[1] and h.shape[1] <= 16384)


def add_norm_router_logits(h: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                           router_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * norm_weight, the router's partial logits [S, T, E] of that
    norm, as ``router_logits(split=True)`` gives them) in one launch: ``norm_triton.add_rms_norm_triton``'s
    outputs, and logits from its rounded norm with fp32 products and sums. ``add_norm_router_applies``
    says which inputs it takes."""
    T, D = h.shape
    E = router_weight.shape[0]
    block_d, parts = router_chunks(D)
    h_out, y = torch.empty_like(h), torch.empty_like(h)
    out = torch.empty(parts, T, E, dtype=torch.float32, device=h.device)
    if T:
        _add_norm_router_kernel[(triton.cdiv(E, 32), parts, T)](
            h, delta, norm_weight, router_weight, h_out, y, out, T, E, D, h.stride(0), delta.stride(0),
            h_out.stride(0), y.stride(0), eps, BLOCK=triton.next_power_of_2(D), BLOCK_E=32, BLOCK_D=block_d,
            num_warps=norm_triton.ADD_NORM_WARPS, **pdl.launch(out.device))
    return h_out, y, out


# Warps of the route kernel's one program a token: enough for ``ROUTE_LOGITS_PER_LANE`` experts a
# lane. Its K rounds of argmax are reductions over the experts, across warps through shared memory
# and a barrier each, within one warp by shuffles: kimi-linear's 256 experts on one warp made its
# graph-replayed step 0.05-0.1 ms faster than four at batch 1 and 16 (RESULTS.md tenth session).
# K3's 896 (1,024 lanes' worth) on one warp: 32 logits a lane over 28 partial rows and 16 rounds,
# 168 registers and a spill (sm_90, Triton 3.6), 41 us a call; on four warps 96 registers, 8.4 us
# (k3-slice batch-1 graph 2.79-2.88 -> 2.58 ms, twenty-sixth session). ``ROUTE_WARPS``: a fixed
# count instead (A/B timing; bench/kernels_small.py --route-warps).
ROUTE_LOGITS_PER_LANE = 8
ROUTE_WARPS: int | None = None


def route_warps(num_experts: int) -> int:
    """The route kernel's warps for ``num_experts`` (rounded up to a power of two): 1 up to 256, 4
    at K3's 896, at most 8."""
    if ROUTE_WARPS:
        return ROUTE_WARPS
    return max(1, min(8, triton.next_power_of_2(num_experts) // (32 * ROUTE_LOGITS_PER_LANE)))


# Up to this many partial sums (``router_logits(split=True)``: 18 for kimi-linear, 28 for K3) the
# route kernel's loop over them is unrolled, all their loads in flight together; 0: a loop (A/B).
ROUTE_STATIC_PARTS = 32


def route_triton(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, renormalize: bool, scaling: float,
                 score_func: str = "sigmoid", num_shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``moe_ref.route`` for one expert group in one launch (the torch form takes ~7): logits
    [T, E] (or [P, T, E] partial sums, added first) -> (weights [T, K + S] fp32, ids [T, K + S]
    int64), the last S = ``num_shared`` columns the always-on experts E, E + 1, ... with weight 1
    (shared experts joined to the stacks)."""
    parts = logits if logits.dim() == 3 else logits[None]  # [S, T, E] partial sums (router_logits(split=True))
    _, T, E = parts.shape
    w = torch.empty(T, top_k + num_shared, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k + num_shared, dtype=torch.int64, device=logits.device)
    if T:
        parts = parts if parts.stride(-1) == 1 else parts.contiguous()
        _route_kernel[(T,)](parts, bias if bias is not None else parts, w, ids, parts.shape[0], parts.stride(0),
                            parts.stride(1), E, float(scaling),
                            K=top_k, K_P=triton.next_power_of_2(top_k), E_P=triton.next_power_of_2(E),
                            HAS_BIAS=bias is not None, RENORM=renormalize, SIGMOID=score_func == "sigmoid",
                            NUM_SHARED=num_shared, num_warps=route_warps(E),
                            STATIC_PARTS=parts.shape[0] if parts.shape[0] <= ROUTE_STATIC_PARTS else 0,
                            **pdl.launch(w.device))
    return w, ids


@functools.lru_cache(maxsize=None)
def has_bf16x2_mul(device: torch.device) -> bool:
    """``mul.rn.bf16x2`` (our upcast's last step) needs sm_90 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


# The MXFP4 upcast for bf16 activations at decode (row blocks of 16): "asm" (ours, ``_mx_group_asm``)
# or "dot_scaled". Same H200 run, K3's experts, best tile of each (RESULTS.md seventh session):
# 1 token 0.275 vs 0.244 ms, 16 tokens 2.524 vs 2.648, 64 tokens 5.602 vs 5.906. So "asm" serves
# decode steps from ASM_MIN_ASSIGNMENTS token-expert pairs up (K3: 8 tokens); smaller steps and
# prefill row blocks take tl.dot_scaled (one K = 32 MMA per scale group was 4.5x slower at 8K).
MX_UPCAST = "asm"
ASM_MIN_ASSIGNMENTS = 128

# Serving on sm_90 rewrites MXFP4 expert stacks into the MMA-operand layout at load
# (``moe.RoutedExperts.use_mma_layout``), which every grouped GEMM then reads through "mx_mma".
# K3's experts on the H200, autotuned (RESULTS.md twelfth session): decode 1 / 16 / 64 tokens
# 0.170 / 1.684 / 3.772 ms = 39 / 49 / 49 % of copy, against the checkpoint layout's best
# 0.234 / 2.476 / 5.499 (28 / 33 / 33 %); prefill of 8K tokens (row blocks of 64) 46.9 ms, as
# tl.dot_scaled's 46.5 on the checkpoint layout (27 % of matmul). False keeps that layout.
MMA_LAYOUT = True

# Decode row blocks over MMA-layout experts whose scales fold (``RoutedExperts.folded_scales``)
# go through moe_gluon's kernel: cp.async copy ring of 2 K steps, scale folded into the upcast,
# async wgmma chains. K3's experts on the H200 (RESULTS.md fourteenth session), row blocks of
# ``GLUON_DECODE_ROWS`` = 8 (wgmma N = 8, 66 registers): 1 / 16 / 64 tokens 0.106 / 1.068 / 2.584
# ms = 63 / 77 / 71 % of copy; of 16: 58 / 70 / 68 %; "mx_mma" (16): 39 / 49 / 48 %. False: "mx_mma".
GLUON_DECODE = True
GLUON_DECODE_ROWS = 8
# Prefill row blocks through moe_gluon's kernel too. K3's experts at 8K tokens on the H200 (RESULTS.md
# fifteenth session): "mx_mma" 47.1 ms (26 % of the bf16 matmul ceiling); Gluon, row blocks of 64,
# 4 warps 34.7; 8 warps (``GLUON_PREFILL_WARPS``, its STACKED form) 29.3; row blocks of mixed sizes
# (``GLUON_PREFILL_SIZES``) 28.2; with the programs column tile fastest (moe_gluon.COLS_FIRST_MIN_ROWS)
# 24.4 ms: 50 % of matmul.
GLUON_PREFILL = True
GLUON_PREFILL_WARPS = 8
# Prefill row blocks of mixed sizes (``expert_sort.sort_by_expert_sizes``) for the Gluon kernel; None: 64 alone.
GLUON_PREFILL_SIZES = (16, 32, 64, 128)
# The Triton kernel's programs column tile fastest from row blocks of this many (as
# ``moe_gluon.COLS_FIRST_MIN_ROWS``: a prefill row block's programs share its gathered activations in
# L2). Kimi-Linear's bf16 experts at 8K tokens, row blocks of 128: 2.62 ms against 3.04 (49 against
# 43 % of matmul), every tile faster (fifteenth session). 1 << 30: never.
TRITON_COLS_FIRST_MIN_ROWS = 64



def weights_mode(mx: bool, act_dtype: torch.dtype, device: torch.device, block_m: int, num_assign: int,
                 mx_upcast: str | None = None) -> str:
    """The grouped GEMM's WEIGHTS: "bf16"; for MXFP4, the exact decode for non-bf16 activations,
    else our upcast ("mx_asm") where asked or where it was measured to win (decode row blocks from
    ``ASM_MIN_ASSIGNMENTS`` up, on sm_90+ or interpreted), tl.dot_scaled elsewhere."""
    if mx_upcast not in (None, "dot_scaled", "asm", "mma", "gluon"):
        raise ValueError(f"mx_upcast {mx_upcast!r}: dot_scaled, asm, mma or gluon")
    if not mx:
        return "bf16"
    if mx_upcast == "mma":
        return "mx_mma"
    upcast = mx_upcast or ("asm" if MX_UPCAST == "asm" and block_m <= 16 and num_assign >= ASM_MIN_ASSIGNMENTS
                           and (interpreted() or has_bf16x2_mul(device)) else "dot_scaled")
    if upcast == "asm" and (act_dtype == torch.bfloat16 or interpreted()):
        return "mx_asm"
    return "mx_decode" if act_dtype != torch.bfloat16 else "mx_dot_scaled"


# Tiles pinned per (N, K, rows class) ahead of the autotuner's (bf16 and upcast-in-registers weights),
# (BLOCK_N, SWAP_AB, warps, stages[, BLOCK_K]): the autotuner times a GEMM alone, cold; in a decode
# step it runs inside a PDL chain. For A/B timing of the graph-replayed step (bench/gpu_check_graphs.py --ab).
PINNED: dict[tuple[int, int, int], tuple] = {}

# bf16 experts take K tiles of 128 (instead of 64) up to this rows class (decode steps of up to ~113
# tokens at top-9; prefill's larger classes keep 64): twice the weight bytes in flight a program,
# where few rows leave the GEMM latency-bound. Kimi-linear-48b on the H200, graph-replayed steps:
# batch 1 grouped GEMMs 981 -> 950 us a step, batch 16 7,700 -> 7,380 us (10.17 -> 9.87 ms a step;
# tiles picked in the chain, RESULTS.md twenty-fourth session); batch 32 / 64 13.91 / 18.98 ->
# 13.80 / 18.45 ms (the autotuner's tiles, twenty-fifth session).
BF16_WIDE_K_MAX_ROWS = 1024


def grouped_gemm(x: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, num_assign: int, top_k: int,
                 weight: torch.Tensor, scale: torch.Tensor | None, n_out: int, block_m: int = 16,
                 block_k: int | None = None, tiles: dict | None = None, up: tuple | None = None,
                 act: tuple = ("silu", 1.0, None), out_dtype: torch.dtype = torch.float32,
                 row_scale: torch.Tensor | None = None, mx_upcast: str | None = None,
                 out: torch.Tensor | None = None, static_tail: int = 0, static_expert0: int = 0,
                 split_k: int = 1, prefetch: bool = False) -> torch.Tensor:
    """out[a] = W[expert(a)] @ x[a // top_k] for every assignment a: [num_assign, n_out] in
    ``out_dtype``, into ``out`` where given (only the rows of ``rows`` are written). ``weight``:
    bf16 [E, N, K] or MXFP4 packed uint8 [E, N, K/2] with ``scale`` [E, N, K/32]. ``up`` = (weight,
    scale) of the up projection fuses the GLU ``act`` into the epilogue; ``row_scale`` [num_assign]
    fp32 multiplies each output row (the routing weights). ``tiles`` (BLOCK_N, SWAP_AB, num_warps,
    num_stages, optionally BLOCK_K) None: ``PINNED``'s, else autotuned for this shape. MXFP4 with bf16 activations goes through
    tl.dot_scaled with K tiles of up to 128 (64 packed bytes a weight row); fp32 activations take
    the exact hand-decoded path. ``mx_upcast``: "asm" for our PTX upcast ("mx_asm") instead,
    "dot_scaled", or None: ``MX_UPCAST`` where it was measured to win (decode row blocks from
    ``ASM_MIN_ASSIGNMENTS`` up), tl.dot_scaled elsewhere; for weights in the MMA layout "mma"
    (``_mx_tile_mma``) or "gluon" (``moe_gluon``, E8M0 bytes <= 128). ``tiles["cols_first"]``:
    programs column tile fastest (by default from row blocks of ``TRITON_COLS_FIRST_MIN_ROWS``, the
    Gluon kernel's ``moe_gluon.COLS_FIRST_MIN_ROWS``). ``static_tail``: the last row blocks, one
    assignment each (a one-token layout), are of the experts static_expert0, static_expert0 + 1,
    ... whatever ``block_expert`` says, and run before the wait on the previous kernel (``rows``
    must then be a constant, not written in the step: ``one_row_blocks``). ``split_k`` (the Gluon
    kernel's): fp32 partials for the caller to sum (``moe_gluon.gluon_grouped_gemm``). ``prefetch``:
    ``rows`` and ``block_expert`` were written two or more launches back, so the Gluon kernel may
    start its weights' copies before the PDL wait."""
    mx = scale is not None
    K = x.shape[1]
    if split_k != 1 and not (mx and mx_upcast == "gluon"):
        raise ValueError("split_k is the Gluon kernel's (MMA-layout MXFP4 weights, mx_upcast='gluon')")
    if mx and mx_upcast == "gluon":  # MMA-layout weights through the Gluon kernel (moe_gluon)
        from .moe_gluon import gluon_grouped_gemm

        opts = {"warps": GLUON_PREFILL_WARPS if block_m >= 64 else 4}
        opts.update({k: tiles[t] for k, t in (("maxnreg", "maxnreg"), ("warps", "num_warps"),
                                              ("cols_first", "cols_first")) if tiles and t in tiles})
        return gluon_grouped_gemm(x, rows, block_expert, num_assign, top_k, weight, scale, n_out, block_m, up=up,
                                  act=act, out_dtype=out_dtype, row_scale=row_scale, out=out, split_k=split_k,
                                  prefetch=prefetch, static_tail=static_tail, static_expert0=static_expert0, **opts)
    weights = weights_mode(mx, x.dtype, x.device, block_m, num_assign, mx_upcast)
    rows_class = min(triton.next_power_of_2(num_assign), 4096)
    if tiles is None and (n_out, K, rows_class) in PINNED:
        tiles = dict(zip(("BLOCK_N", "SWAP_AB", "num_warps", "num_stages", "BLOCK_K"), PINNED[n_out, K, rows_class]))
    if tiles is not None:  # (a copy: the caller's dict stays whole)
        tiles = dict(tiles)
        block_k = tiles.pop("BLOCK_K", block_k)
    if block_k is None:  # the widest tile that divides K (MXFP4 tiles hold whole 32-value scale groups)
        widths = (64, 32, 16) if weights in ("bf16", "mx_decode") else (128, 64, 32)
        if weights == "bf16" and rows_class <= BF16_WIDE_K_MAX_ROWS:
            widths = (128,) + widths
        block_k = next((b for b in widths if K % b == 0 and not (mx and b % 32)), 64)
    if K % block_k or (mx and block_k % 32):
        raise ValueError(f"the reduction width {K} must be a multiple of BLOCK_K={block_k} (and of 32 for MXFP4)")
    if out is None:
        out = torch.empty(num_assign, n_out, dtype=out_dtype, device=x.device)
    s = scale if mx else weight
    w_up, s_up = up if up is not None else (weight, s)
    s_up = s_up if mx else w_up
    kind, beta, linear_beta = act
    # Every expert's segment starts with its rows, so the blocks holding any are the leading ones
    # and number at most num_assign: at batch 1 that is 16 blocks of the ~840 the buffer has room
    # for (K3, top-16 of 896), so ~98 % of the programs are never launched.
    row_blocks = min(rows.numel() // block_m, num_assign)
    kernel, tiles = (_grouped_gemm_tuned, {}) if tiles is None else (_grouped_gemm_kernel, tiles)
    cols_first = tiles.pop("cols_first", block_m >= TRITON_COLS_FIRST_MIN_ROWS) and row_blocks < 65536
    kernel[lambda meta: (triton.cdiv(n_out, meta["BLOCK_N"]), row_blocks)[::1 if cols_first else -1]](
        x, weight, s, w_up, s_up, out, rows, block_expert, row_scale if row_scale is not None else out,
        num_assign, rows_class, top_k, n_out, K,
        x.stride(0), weight.stride(0), weight.stride(1), s.stride(0), s.stride(1), out.stride(0),
        float(beta), float(linear_beta or 1.0), static_expert0,
        WEIGHTS=weights, INTERPRETED=interpreted(), GLU=up is not None,
        SITU=kind == "situ", LINEAR_CLIP=linear_beta is not None,
        HAS_ROW_SCALE=row_scale is not None, BLOCK_M=block_m, BLOCK_K=block_k, COLS_FIRST=cols_first,
        STATIC_TAIL=static_tail, **tiles,
        **pdl.launch(out.device),
    )
    return out


def row_block(assignments: int, num_experts: int, mma: bool, gluon_ok: bool) -> int:
    """Row blocks of 16 while experts see a few rows each (decode), of ``GLUON_DECODE_ROWS`` (8)
    for the Gluon kernel while they see under two on average (K3 at 64 tokens: 1.1; an expert past
    8 rows reads its weights twice); of 64 once they see dozens and 128 past a hundred (prefill),
    so each upcast weight tile serves that many rows (8K tokens on K3: 128 rows 13 % faster than 64
    on the H200, checkpoint layout). MMA-layout experts keep 64 ("mx_mma" at 8K tokens on K3: 46.9
    ms with 64, 55.6 with 128); where the Gluon kernel takes them, ``experts_triton`` turns 64 into
    blocks of ``GLUON_PREFILL_SIZES`` (whole blocks of 128 and one tail block an expert)."""
    if assignments < 16 * num_experts:
        return GLUON_DECODE_ROWS if gluon_ok and GLUON_DECODE and assignments < 2 * num_experts else 16
    if assignments < 128 * num_experts or mma:
        return 64
    return 128


# Decode steps whose Gluon grouped GEMM has too few programs to fill the GPU split K over up to
# this many programs an SM (0: never): kimi-linear's experts quantised at load (``--quantization
# mxfp4``) at one token are 9 experts x 16 column tiles of 64 rows, 144 programs with 18 K steps
# each; K3's at one token already 17 x 48. Partials in fp32, summed in a fixed order by the GLU and
# the combine.
GLUON_SPLIT_K_PER_SM = 8


def gluon_split_k(row_blocks: int, n_out: int, K: int, device: torch.device) -> int:
    """The largest divisor of the GEMM's K steps that keeps its programs within
    ``GLUON_SPLIT_K_PER_SM`` an SM (1: no split)."""
    from .moe_gluon import BLOCK_K, BLOCK_N

    room = GLUON_SPLIT_K_PER_SM * sm_count(device) // max(row_blocks * triton.cdiv(n_out, BLOCK_N), 1)
    steps = K // BLOCK_K
    return max(d for d in range(1, min(room, steps) + 1) if steps % d == 0) if room > 1 else 1


def mma_upcast(block_m: int, gluon_ok: bool) -> str:
    """The grouped GEMM for MMA-layout experts: moe_gluon's ("gluon") at decode row blocks (up to
    16, ``GLUON_DECODE``) and prefill ones (32 to 128, ``GLUON_PREFILL``); "mma" elsewhere."""
    gluon = gluon_ok and ((GLUON_DECODE and block_m <= 16) or (GLUON_PREFILL and block_m >= 32))
    return "gluon" if gluon else "mma"


# From this many assignments up (prefill), the down GEMM writes each weighted expert row in the
# activation dtype, not fp32, and the combine sums them in fp32 (as vLLM's fused_moe keeps its
# per-expert rows): at 8K kimi-linear tokens y is 604 MB of fp32 written and read back a layer.
# kimi-linear-48b's eager prefill steps on the H200, kernel ms, three rounds: 16 x 512 125.8-126.8 ->
# 116.9-124.1, 1 x 8,192 133.4-136.7 -> 124.4-133.1 (RESULTS.md forty-first session).
ROWS_IN_ACTIVATION_DTYPE_FROM = 4096


# A one-token step's joined shared experts computed by their gate / up programs before the PDL
# wait, i.e. during the routing (``_grouped_gemm_kernel``'s STATIC_TAIL): kimi-linear batch 1 on the
# H200, grouped GEMMs 962.9 -> 947.6 us a step, the route +6 (RESULTS.md twenty-third session).
SHARED_BEFORE_WAIT = True


def experts_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts, block_m: int | None = None,
                   norm=None, add: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                   block_sizes: tuple | None = None, **blocks) -> torch.Tensor:
    """Drop-in for ``moe_ref.experts_ref`` over a ``model.moe.RoutedExperts``: gate/up GEMM, GLU,
    down GEMM, weighted sum (fp32), then ``combine_experts``'s optional norm / add / cast. No host
    sync. Row blocks: ``row_block``, or of each of ``block_sizes`` (``sort_by_expert_sizes``; by
    default ``GLUON_PREFILL_SIZES`` where the Gluon kernel takes prefill blocks); MMA-layout
    experts' kernel: ``mma_upcast``."""
    T, top_k = ids.shape
    E = experts.num_experts + experts.num_shared  # ids may name joined shared experts (moe.RoutedExperts.join_shared)
    if T == 0:
        return torch.empty(0, experts.out_features, dtype=out_dtype or torch.float32, device=x.device)
    mma = getattr(experts, "mma_layout", False)  # (moe.RoutedExperts.use_mma_layout)
    x = x.to(experts.dtype).contiguous()
    # moe_gluon may serve (its scale fold checked at load, its copies 16-byte aligned)
    gluon_ok = mma and experts.folded_scales and not interpreted() and blocks.get("mx_upcast") is None \
        and x.data_ptr() % 16 == 0
    if block_m is None:
        block_m = row_block(T * top_k, E, mma, gluon_ok)
    if block_sizes is None and GLUON_PREFILL_SIZES and block_m == 64 and mma_upcast(64, gluon_ok) == "gluon":
        block_sizes = GLUON_PREFILL_SIZES
    if block_sizes:
        layouts = sort_by_expert_sizes(ids, E, tuple(block_sizes))
    elif T == 1:  # one token's experts are distinct: a block per assignment, in routing order, is the sort's layout
        layouts = [(block_m, one_row_blocks(top_k, block_m, ids.device), ids.reshape(-1))]
    else:
        layouts = [(block_m, *sort_by_expert(ids, E, block_m))]
    num_assign = T * top_k
    stored = experts.stack
    w1, s1 = stored("w1")
    w2, s2 = stored("w2")
    I, D = experts.intermediate, experts.out_features
    split_up = split_down = 1
    if len(layouts) == 1 and layouts[0][0] <= 16 and mma_upcast(layouts[0][0], gluon_ok) == "gluon":  # decode
        row_blocks = min(layouts[0][1].numel() // layouts[0][0], num_assign)
        split_up, split_down = (gluon_split_k(row_blocks, n, k, x.device) for n, k in ((I, x.shape[1]), (D, I)))
    h = torch.empty(num_assign, I, dtype=experts.dtype, device=x.device)
    y_dtype = experts.dtype if num_assign >= ROWS_IN_ACTIVATION_DTYPE_FROM else torch.float32
    y = torch.empty(num_assign * split_down, D, dtype=y_dtype, device=x.device)
    row_scale = weights.float().flatten().contiguous()
    # a one-token step's joined shared experts (the last ids) run before its routing is known
    static = experts.num_shared if T == 1 and SHARED_BEFORE_WAIT and not block_sizes else 0
    for bm, rows, block_expert in layouts:  # (each layout's rows are its own: h's rows are written, then read)
        opts = blocks
        if mma and blocks.get("mx_upcast") not in ("mma", "gluon"):  # (the checkpoint layout's upcasts cannot read it)
            opts = dict(blocks, mx_upcast=mma_upcast(bm, gluon_ok))
        # gate and up GEMMs share the activation tile; the GLU runs in the epilogue (no gate/up round trip)
        if split_up > 1:  # ... or after the split's partials are summed
            parts = grouped_gemm(x, rows, block_expert, num_assign, top_k, w1, s1, I, bm, up=stored("w3"),
                                 out_dtype=torch.float32, split_k=split_up, static_tail=static,
                                 static_expert0=experts.num_experts, **opts)
            glu_triton(parts[:, :I], parts[:, I:], experts.act[0], *experts.act[1:], split=split_up, out=h)
        else:
            grouped_gemm(x, rows, block_expert, num_assign, top_k, w1, s1, I, bm, up=stored("w3"), act=experts.act,
                         out_dtype=experts.dtype, out=h, static_tail=static, static_expert0=experts.num_experts,
                         **opts)
        # rows of h are assignments already; the routing weights scale the rows in the epilogue; the
        # routing or sort that wrote rows and block_expert is two or more launches back
        grouped_gemm(h, rows, block_expert, num_assign, 1, w2, s2, D, bm, row_scale=row_scale, out=y,
                     split_k=split_down, prefetch=True, **opts)
    return combine_experts(y, top_k * split_down, norm, add, out_dtype)


@triton.jit
def _combine_kernel(Y, NORM_W, ADD, OUT, PART, TICKETS, D, stride_add, eps, TOP_K: tl.constexpr, NORM: tl.constexpr,
                    HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr = 1, ROW: tl.constexpr = 1,
                    USE_PDL: tl.constexpr = False):
    """Program (token, column block). The rows' loop is unrolled (TOP_K a constant), so all their
    loads are in flight at once (a kimi-linear batch-1 step: 0.034 ms of combines instead of 0.051,
    RESULTS.md tenth session). With NORM and SPLIT column blocks a row, each block's sum and sum of
    squares go to PART ([T, D + SPLIT] fp32) and the token's last block (ops/tickets.py) normalises
    the whole row from there (ROW: D padded to a power of two)."""
    pdl_start(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(Y + (t * TOP_K + j) * D + cols, mask=mask, other=0.0)
    if NORM and SPLIT > 1:
        part = PART + t * (D + SPLIT)
        tl.store(part + cols, acc, mask=mask)
        tl.store(part + D + block, tl.sum(acc * acc, 0))
        if last_arrival(TICKETS, t, SPLIT):
            sq = 0.0
            for s in tl.static_range(SPLIT):  # a fixed order; unrolled, the loads in flight together
                sq += tl.load(part + D + s, cache_modifier=".cg")
            row = tl.arange(0, ROW)
            row_acc = tl.load(part + row, mask=row < D, other=0.0, cache_modifier=".cg")
            _combine_store(row_acc, sq, NORM_W, ADD, OUT, t, row, row < D, D, stride_add, eps, NORM, HAS_ADD)
    else:
        _combine_store(acc, tl.sum(acc * acc, 0), NORM_W, ADD, OUT, t, cols, mask, D, stride_add, eps, NORM, HAS_ADD)


@triton.jit
def _combine_store(acc, sq, NORM_W, ADD, OUT, t, cols, mask, D, stride_add, eps, NORM: tl.constexpr,
                   HAS_ADD: tl.constexpr):
    """The columns ``cols`` of the token's combined row: normalised (its sum of squares ``sq``), the
    shared experts' output added, rounded once."""
    if NORM:
        acc = acc / tl.sqrt(sq / D + eps) * tl.load(NORM_W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        acc += tl.load(ADD + t * stride_add + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + t * D + cols, acc.to(OUT.dtype.element_ty), mask=mask)


# Columns a combine program takes when the row is normalised (K3's latent norm: 16 expert rows of
# 3,584 columns a token), the token's last block normalising the row. One program a token read all
# 16 rows alone: 205 registers on 4 warps, too few for its 512 loads a thread to be in flight
# together; the k3-slice timeline charged it 14.5 us a call at batch 1, and 8 or 16 warps did not
# help (RESULTS.md twenty-seventh session). 0: one program a token (A/B timing).
COMBINE_NORM_BLOCK = 256
# Columns a combine program takes without the norm (RESULTS.md fifty-sixth session).
COMBINE_BLOCK = 256
# Warps of a combine program that normalises a whole row alone (COMBINE_NORM_BLOCK = 0); None: 4 up
# to 4,096 columns, else 8.
COMBINE_NORM_WARPS: int | None = None


def combine_experts(y: torch.Tensor, top_k: int, norm=None, add: torch.Tensor | None = None,
                    out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per token: the sum (in fp32) of its ``top_k`` weighted expert rows of y [T * top_k, D] (fp32, or
    the activation dtype at prefill sizes: ``ROWS_IN_ACTIVATION_DTYPE_FROM``), then
    ``norm`` (an RMSNorm module: K3's latent norm) and / or ``+ add`` (the shared experts' output),
    rounded once to ``out_dtype`` (None: fp32). One launch instead of torch's sum, norm, cast and
    add (4-8 launches a MoE layer)."""
    D = y.shape[-1]
    T = y.shape[0] // top_k
    out = torch.empty(T, D, dtype=out_dtype or torch.float32, device=y.device)
    if add is not None and add.stride(-1) != 1:
        add = add.contiguous()
    if T:
        w = norm.weight if norm is not None else y
        a = add if add is not None else y
        # Column blocks of COMBINE_BLOCK spread a decode step's few rows over more SMs (one program per
        # row took 7 us a layer at batch 1 on kimi-linear, RESULTS.md sixth session); with the norm, blocks of
        # COMBINE_NORM_BLOCK, the row's last one normalising it.
        row = triton.next_power_of_2(D)
        block = min(COMBINE_BLOCK, row) if norm is None else min(COMBINE_NORM_BLOCK or row, row)
        split = triton.cdiv(D, block)
        norm_split = norm is not None and split > 1
        part = torch.empty(T, D + split, dtype=torch.float32, device=y.device) if norm_split else y
        _combine_kernel[(T, split)](
            y, w, a, out, part, tickets(y.device, T) if norm_split else part, D, a.stride(0),
            float(norm.eps) if norm is not None else 0.0, TOP_K=top_k, NORM=norm is not None, HAS_ADD=add is not None,
            BLOCK=block, SPLIT=split if norm_split else 1, ROW=row if norm_split else 1,
            num_warps=(norm is not None and not norm_split and COMBINE_NORM_WARPS) or (4 if block <= 4096 else 8),
            **pdl.launch(out.device))
    return out

"""The MXFP4 grouped expert GEMM over MMA-layout weights in Gluon (Triton's explicit-layout
dialect): the same computation as ``moe_triton`` "mx_mma", written so that what the Triton
language cannot guarantee is stated and checked by the compiler.

STATUS: compiled for sm_90 (tests/test_sm90_compile.py, Triton 3.6 and 3.9); **not yet run on a
GPU**: opt-in only (``grouped_gemm(..., mx_upcast="gluon")``), verified by
bench/gpu_check_kernels.py's MMA-layout rows and timed by bench/kernels_moe.py before it may serve.

Why (RESULTS.md twelfth session): "mx_mma" reaches 49 % of copy at K3 decode; Triton 3.6 waits for
every register-operand wgmma right after issuing it, and its inferred layouts send the tile
through shared memory if the block scale joins the upcast. Here (``bench/gluon_probe.py``):
- the weight words load in a [16-row block, lane, byte] BlockedLayout, one warp a block, and the
  upcast tile converts to the wgmma register operand with ``assert_trivial=True``;
- the E8M0 scale is folded into the upcast's exact multiply (2^(E8M0 - 1) per row, two rows a
  word), so one accumulator chain runs over the whole K loop: needs E8M0 <= 128 (weights up to 12
  in magnitude), checked by the wrapper's caller at load (``MMA_MAX_SCALE``);
- wgmma runs async, at most one group (gate and up: two) in flight, the first K step peeled so
  the loop's zero-trip path never hands ptxas a zero-moved accumulator (C7515 serialisation);
- activations (gathered token rows) go through two shared-memory buffers, each rewritten only
  after the wgmmas that read it have completed.
Programs: (row block of BLOCK_M assignment rows, 64 weight rows), 4 warps, K steps of 64.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from .glu_triton import glu
from .moe_triton import _E2M1_WORD_TO_BF16_ASM

# Largest E8M0 byte the folded multiply takes: 2^(E8M0 - 1) must be a finite bf16.
MMA_MAX_SCALE = 128

# ``_E2M1_WORD_TO_BF16_ASM`` with each mul.rn.bf16x2 by the row's 2^(E8M0 - 1) instead of the
# constant 2^126 ($5: bytes 0 and 2's row g twice; $6: bytes 1 and 3's row g + 8).
_text = _E2M1_WORD_TO_BF16_ASM.value
for _i, _m in enumerate(("$5", "$6", "$5", "$6")):
    _text = _text.replace(f"mul.rn.bf16x2 ${_i}, a, two126", f"mul.rn.bf16x2 ${_i}, a, {_m}")
_SCALED_WORD_TO_BF16_ASM = gl.constexpr(_text)

BLOCK_N = 64  # weight rows a program: four 16-row blocks, one a warp
BLOCK_K = 64  # codes a K step: two 32-code scale groups


@gluon.jit
def _weight_group(W_e, S_e, offs, wmask, srows, smask, kk, stride_sn, word_l: gl.constexpr, mult_l: gl.constexpr,
                  a_l: gl.constexpr):
    """The scaled bf16 weight tile [64, 32] of the group at kk as the wgmma register operand."""
    packed = gl.load(W_e + offs + (kk // 32) * 256, mask=wmask, other=0)  # [block, lane, byte]
    scale = gl.load(S_e + srows * stride_sn + kk // 32, mask=smask, other=0)  # [block, lane, h]: rows g, g + 8
    mult = ((scale.to(gl.int16) + 126) << 7).to(gl.bfloat16, bitcast=True)  # 2^(E8M0 - 1)
    mult = gl.convert_layout(gl.join(mult, mult).reshape([4, 32, 1, 2, 2]), mult_l, assert_trivial=True)
    mult = gl.broadcast(mult, packed.reshape([4, 32, 2, 2, 2]).to(gl.bfloat16))[0]  # to the bytes (s, h, q0)
    mult = gl.convert_layout(mult.reshape([4, 32, 8]), word_l, assert_trivial=True)
    lo, hi = gl.inline_asm_elementwise(_SCALED_WORD_TO_BF16_ASM, "=r,=r,=r,=r,r,r,r", [packed, mult],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
    w = gl.join(lo, hi).reshape([4, 8, 4, 2, 2, 2, 2]).permute([0, 4, 1, 3, 6, 2, 5]).reshape([64, 32])
    return gl.convert_layout(w, a_l, assert_trivial=True)  # rows (block, h, g); k (s, o, c, q0)


@gluon.jit
def _k_step(acc, acc_up, k0, X, W_e, S_e, WU_e, SU_e, tok, valid, xk, offs, wmask, srows, smask, x_smem,
            stride_xt, stride_sn, GLU: gl.constexpr, FIRST: gl.constexpr, word_l: gl.constexpr,
            mult_l: gl.constexpr, a_l: gl.constexpr):
    """Two groups: stage each group's activations [32, BLOCK_M] in its buffer, issue the gate's
    (and up's) wgmma on the chain, and wait until only this group's are in flight, so the buffer
    the next group rewrites is no longer read."""
    for g in gl.static_range(2):
        kk = k0 + 32 * g
        xt = gl.load(X + gl.expand_dims(tok, 0) * stride_xt + gl.expand_dims(kk + xk, 1),
                     mask=gl.expand_dims(valid, 0), other=0.0)
        x_smem.index(g).store(xt)
        fence_async_shared()
        w = _weight_group(W_e, S_e, offs, wmask, srows, smask, kk, stride_sn, word_l, mult_l, a_l)
        acc = warpgroup_mma(w, x_smem.index(g), acc, use_acc=not (FIRST and g == 0), is_async=True)
        if GLU:
            wu = _weight_group(WU_e, SU_e, offs, wmask, srows, smask, kk, stride_sn, word_l, mult_l, a_l)
            acc_up = warpgroup_mma(wu, x_smem.index(g), acc_up, use_acc=not (FIRST and g == 0), is_async=True)
            acc, acc_up = warpgroup_mma_wait(num_outstanding=2, deps=[acc, acc_up])
        else:
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
    return acc, acc_up


@gluon.jit
def _grouped_gemm_kernel(X, W, S, W_UP, S_UP, OUT, ROWS, EXPERTS, ROW_SCALE,
                         num_assign, top_k, N, K, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_on,
                         beta, linear_beta, GLU: gl.constexpr, SITU: gl.constexpr, LINEAR_CLIP: gl.constexpr,
                         HAS_ROW_SCALE: gl.constexpr, BLOCK_M: gl.constexpr):
    """out[rows, 64 cols] = (GLU of) x_rows @ W[e][cols]^T (scaled MXFP4, MMA layout), times the
    rows' routing weights with HAS_ROW_SCALE. Weight tiles are the wgmma's register operand (M =
    weight rows), the gathered activations its shared-memory operand (N = BLOCK_M rows)."""
    word_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])  # [block, lane, byte]
    scale_l: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [4, 1, 1], [2, 1, 0])  # [block, lane, h]
    mult_l: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2, 2], [1, 32, 1, 1, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
    mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
    x_l: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, 4], [0, 1])  # [k, row]: 16-byte loads along k
    x_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, BLOCK_M], gl.bfloat16)
    out_l: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    # Row blocks of padding only (valid rows lead each block) stream no weights.
    if gl.load(ROWS + pid_m * BLOCK_M) < num_assign:
        e = gl.load(EXPERTS + pid_m).to(gl.int64)
        rows = gl.load(ROWS + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, x_l)))
        valid = rows < num_assign
        tok = gl.where(valid, rows // top_k, 0).to(gl.int64)
        xk = gl.arange(0, 32, layout=gl.SliceLayout(1, x_l))
        blk = pid_n * 4 + gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, word_l)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, word_l)))
        byte = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, word_l)))
        offs = gl.expand_dims(gl.expand_dims(blk * 16 * stride_wn, 1), 2) \
            + gl.expand_dims(gl.expand_dims(lane * 8, 0), 2) + gl.expand_dims(gl.expand_dims(byte, 0), 1)
        wmask = gl.expand_dims(gl.expand_dims(blk * 16 < N, 1), 2)
        sblk = pid_n * 4 + gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, scale_l)))
        slane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, scale_l)))
        sh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, scale_l)))
        srows = gl.expand_dims(gl.expand_dims(sblk * 16, 1), 2) + gl.expand_dims(gl.expand_dims(slane // 4, 0), 2) \
            + gl.expand_dims(gl.expand_dims(sh * 8, 0), 1)
        smask = gl.expand_dims(gl.expand_dims(sblk * 16 < N, 1), 2)
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 32, BLOCK_M], x_s)
        W_e, S_e = W + e * stride_we, S + e * stride_se
        WU_e, SU_e = W_UP + e * stride_we, S_UP + e * stride_se
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout=mma_l)
        acc_up = gl.zeros([64, BLOCK_M], gl.float32, layout=mma_l)
        acc, acc_up = _k_step(acc, acc_up, 0, X, W_e, S_e, WU_e, SU_e, tok, valid, xk, offs, wmask, srows, smask,
                              x_smem, stride_xt, stride_sn, GLU, True, word_l, mult_l, a_l)
        for k0 in range(64, K, 64):
            acc, acc_up = _k_step(acc, acc_up, k0, X, W_e, S_e, WU_e, SU_e, tok, valid, xk, offs, wmask, srows,
                                  smask, x_smem, stride_xt, stride_sn, GLU, False, word_l, mult_l, a_l)
        acc, acc_up = warpgroup_mma_wait(num_outstanding=0, deps=[acc, acc_up])
        if GLU:
            acc = glu(acc, acc_up, beta, linear_beta, SITU, LINEAR_CLIP, False)
        y = gl.convert_layout(gl.permute(acc, [1, 0]), out_l)  # [rows, cols]
        orow = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_l))
        rows_o = gl.load(ROWS + orow)
        valid_o = rows_o < num_assign
        if HAS_ROW_SCALE:  # the routing weight of each assignment
            y = y * gl.expand_dims(gl.load(ROW_SCALE + gl.where(valid_o, rows_o, 0), mask=valid_o, other=0.0), 1)
        cols = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(0, out_l))
        gl.store(OUT + gl.expand_dims(rows_o, 1) * stride_on + gl.expand_dims(cols, 0), y.to(OUT.dtype.element_ty),
                 mask=gl.expand_dims(valid_o, 1) & gl.expand_dims(cols < N, 0))


def gluon_grouped_gemm(x: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor, num_assign: int,
                       top_k: int, weight: torch.Tensor, scale: torch.Tensor, n_out: int, block_m: int,
                       up: tuple | None = None, act: tuple = ("silu", 1.0, None),
                       out_dtype: torch.dtype = torch.float32, row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_triton.grouped_gemm``'s contract for MMA-layout MXFP4 weights and bf16 activations
    (K a multiple of 64, E8M0 bytes <= ``MMA_MAX_SCALE``: the caller's load-time check)."""
    K = x.shape[1]
    if K % BLOCK_K or x.dtype != torch.bfloat16 or block_m not in (16, 32, 64):
        raise ValueError(f"the Gluon grouped GEMM takes bf16 activations, K % {BLOCK_K} == 0 and row blocks of "
                         f"16, 32 or 64 (got {x.dtype}, K={K}, block_m={block_m})")
    out = torch.empty(num_assign, n_out, dtype=out_dtype, device=x.device)
    w_up, s_up = up if up is not None else (weight, scale)
    kind, beta, linear_beta = act
    row_blocks = min(rows.numel() // block_m, num_assign)
    _grouped_gemm_kernel[(row_blocks, triton.cdiv(n_out, BLOCK_N))](
        x, weight, scale, w_up, s_up, out, rows, block_expert, row_scale if row_scale is not None else out,
        num_assign, top_k, n_out, K, x.stride(0), weight.stride(0), weight.stride(1), scale.stride(0),
        scale.stride(1), out.stride(0), float(beta), float(linear_beta or 1.0), GLU=up is not None,
        SITU=kind == "situ", LINEAR_CLIP=linear_beta is not None, HAS_ROW_SCALE=row_scale is not None,
        BLOCK_M=block_m, num_warps=4)
    return out

"""Compile-only probe (sm_90, no GPU needed): can Gluon, Triton's explicit-layout dialect, do what
the Triton-language MXFP4 grouped GEMM cannot? Not a kernel we serve; a measured fact for the next
step of the MMA-layout path (RESULTS.md twelfth session).

The Triton-language "mx_mma" path (moe_triton.py) reaches 49 % of copy at K3 decode; ncu puts it
at 65 % SM throughput with 5-7 programs an SM, and Triton 3.6 waits for every register-operand
wgmma right after issuing it (and, in the Triton language, where the upcast's registers land is
inferred, so a scale folded into the upcast sent the tile through shared memory). This probe
builds the same weight tile in Gluon with the layouts written out and checks, from the compiled
kernel:
1. the tile from ``mxfp4.to_mma_layout`` bytes converts to the wgmma register operand with
   ``convert_layout(..., assert_trivial=True)`` (compilation fails otherwise);
2. with SCALED, the E8M0 scale folds into the upcast's exact multiply (2^(E8M0 - 1) instead of
   2^126, two rows' multipliers a word as the asm's bf16x2 operands), its layout built by join /
   broadcast with every conversion trivial: the fold that Triton 3.6's inferred layouts turned
   into a shared-memory round trip;
3. whether wgmma is issued asynchronously with one group still in flight (``DEPBAR.LE gsb0,
   0x1``), one accumulator chain over the K loop, or ptxas serialises it (every wait 0x0). It
   does serialise, scaled or not depending on ptxas's mood, when the loop's zero-trip path
   reaches the final wait with zeros moved into the accumulator (C7515); peeling the first K
   step (its first MMA with use_acc=False) removes that path;
4. registers a thread (occupancy).
The activation tile is staged naively (plain loads and stores into shared memory): instruction
counts are an upper bound of the structure, not of a finished kernel. The fold needs E8M0 bytes
<= 128 (weights up to 12 in magnitude), a load-time check for a real kernel.

k3serve/ops/moe_gluon.py is the grouped GEMM built on this skeleton (opt-in until run on a GPU).

Usage: python -m bench.gluon_probe   (put Triton 3.6, the device's, first on PYTHONPATH to read
its compiler: pip install --no-deps --target DIR triton==3.6.0)
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget

from bench.sass_mix import hottest_loop_mix, registers, sass_text
from k3serve.ops.moe_triton import _E2M1_WORD_TO_BF16_ASM

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except ImportError:  # pragma: no cover - a Triton without Gluon
    gluon = None


# The upcast with the block scale folded in: each mul.rn.bf16x2 by the row's 2^(E8M0 - 1) ($5: bytes
# 0 and 2's row g, $6: bytes 1 and 3's row g + 8) instead of the constant 2^126.
_text = _E2M1_WORD_TO_BF16_ASM.value
for _i, _m in enumerate(("$5", "$6", "$5", "$6")):
    _text = _text.replace(f"mul.rn.bf16x2 ${_i}, a, two126", f"mul.rn.bf16x2 ${_i}, a, {_m}")
_SCALED_ASM = triton.language.constexpr(_text)


if gluon is not None:
    @gluon.jit
    def _probe_k_step(acc, k0, W, S, X, offs, srows, xt, xk, x_smem, stride_sn, stride_xt, SCALED: gl.constexpr,
                      IN_FLIGHT: gl.constexpr, FIRST: gl.constexpr, word_l: gl.constexpr, mult_l: gl.constexpr,
                      a_l: gl.constexpr):
        """Two 32-code groups: upcast (scaled), stage the activations, issue the wgmmas, wait."""
        NB: gl.constexpr = 4
        for g in gl.static_range(2):
            kk = k0 + 32 * g
            packed = gl.load(W + offs + (kk // 32) * 256)
            if SCALED:
                scale = gl.load(S + srows * stride_sn + kk // 32)
                mult = ((scale.to(gl.int16) + 126) << 7).to(gl.bfloat16, bitcast=True)  # 2^(E8M0 - 1)
                mult = gl.convert_layout(gl.join(mult, mult).reshape([NB, 32, 1, 2, 2]), mult_l, assert_trivial=True)
                mult = gl.broadcast(mult, packed.reshape([NB, 32, 2, 2, 2]).to(gl.bfloat16))[0]  # bytes (s, h, q0)
                mult = gl.convert_layout(mult.reshape([NB, 32, 8]), word_l, assert_trivial=True)
                lo, hi = gl.inline_asm_elementwise(_SCALED_ASM, "=r,=r,=r,=r,r,r,r", [packed, mult],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            else:
                lo, hi = gl.inline_asm_elementwise(_E2M1_WORD_TO_BF16_ASM, "=r,=r,=r,=r,r", [packed],
                                                   dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=4)
            w = gl.join(lo, hi).reshape([NB, 8, 4, 2, 2, 2, 2]).permute([0, 4, 1, 3, 6, 2, 5]).reshape([64, 32])
            w = gl.convert_layout(w, a_l, assert_trivial=True)  # 1.: no data movement, or no compile
            x_smem.index(g).store(gl.load(X + gl.expand_dims(xt, 0) * stride_xt + gl.expand_dims(kk + xk, 1)))
            fence_async_shared()
            acc = warpgroup_mma(w, x_smem.index(g), acc, use_acc=not (FIRST and g == 0), is_async=True)
        return warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=[acc])

    @gluon.jit
    def _probe_kernel(W, S, X, OUT, K, stride_wn, stride_sn, stride_xt, SCALED: gl.constexpr,
                      IN_FLIGHT: gl.constexpr):
        """out[64 rows, 16] = W_tile (MMA layout, scaled with SCALED) @ X^T, two 32-code groups a K step."""
        NB: gl.constexpr = 4  # 16-row blocks: one a warp
        word_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])  # [block, lane, byte]
        scale_l: gl.constexpr = gl.BlockedLayout([1, 1, 2], [1, 32, 1], [4, 1, 1], [2, 1, 0])  # [block, lane, h]
        mult_l: gl.constexpr = gl.BlockedLayout([1, 1, 2, 2, 2], [1, 32, 1, 1, 1], [4, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        x_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 16], gl.bfloat16)
        blk = gl.program_id(0) * NB + gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, word_l)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, word_l)))
        byte = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, word_l)))
        offs = gl.expand_dims(gl.expand_dims(blk * 16 * stride_wn, 1), 2) \
            + gl.expand_dims(gl.expand_dims(lane * 8, 0), 2) + gl.expand_dims(gl.expand_dims(byte, 0), 1)
        sblk = gl.program_id(0) * NB + gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, scale_l)))
        slane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, scale_l)))
        sh = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, scale_l)))
        srows = gl.expand_dims(gl.expand_dims(sblk * 16, 1), 2) + gl.expand_dims(gl.expand_dims(slane // 4, 0), 2) \
            + gl.expand_dims(gl.expand_dims(sh * 8, 0), 1)  # rows g and g + 8 of the lane
        xk = gl.arange(0, 32, layout=gl.SliceLayout(1, x_l))
        xt = gl.arange(0, 16, layout=gl.SliceLayout(0, x_l))
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 32, 16], x_s)
        acc = gl.zeros([64, 16], gl.float32, layout=mma_l)
        # the first K step peeled (its first MMA ignores acc): on the loop's zero-trip path the
        # accumulator is then still a wgmma's result, not zeros moved in, which makes ptxas
        # serialise every wgmma (C7515)
        acc = _probe_k_step(acc, 0, W, S, X, offs, srows, xt, xk, x_smem, stride_sn, stride_xt, SCALED, IN_FLIGHT,
                            True, word_l, mult_l, a_l)
        for k0 in range(64, K, 64):
            acc = _probe_k_step(acc, k0, W, S, X, offs, srows, xt, xk, x_smem, stride_sn, stride_xt, SCALED,
                                IN_FLIGHT, False, word_l, mult_l, a_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        out_l: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
        rows = gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
        cols = gl.arange(0, 16, layout=gl.SliceLayout(0, out_l))
        gl.store(OUT + gl.expand_dims(gl.program_id(0) * 64 + rows, 1) * 16 + gl.expand_dims(cols, 0),
                 gl.convert_layout(acc, out_l))


def main() -> None:
    if gluon is None:
        print(f"Triton {triton.__version__} has no Gluon")
        return
    sig = {"W": "*u8", "S": "*u8", "X": "*bf16", "OUT": "*fp32", "K": "i32", "stride_wn": "i32", "stride_sn": "i32",
           "stride_xt": "i32", "SCALED": "constexpr", "IN_FLIGHT": "constexpr"}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:8]}
    print(f"Triton {triton.__version__}: every convert_layout(..., assert_trivial=True) compiled (no data movement)")
    for scaled in (False, True):
        src = GluonASTSource(fn=_probe_kernel, signature=sig, constexprs={"SCALED": scaled, "IN_FLIGHT": 1},
                             attrs=attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        total, ops = hottest_loop_mix(kernel)
        waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass_text(kernel))
        print(f"  scale {'folded' if scaled else 'none'}: {registers(kernel)} registers; K step (2 groups, 64 rows "
              f"x 64 codes) {total} instructions: {', '.join(f'{k} {v}' for k, v in ops.most_common(8))}; "
              f"wgmma waits leave in flight: {waits}")


if __name__ == "__main__":
    main()

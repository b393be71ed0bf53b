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
2. wgmma is issued asynchronously with one group still in flight (``DEPBAR.LE gsb0, 0x1``) and
   ptxas does not serialise it;
3. registers a thread (occupancy).
The activation tile is staged naively and no block scale is applied: instruction counts are an
upper bound of the structure, not of a finished kernel.

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


if gluon is not None:
    @gluon.jit
    def _probe_kernel(W, X, OUT, K, stride_wn, stride_xt, ASM: gl.constexpr, IN_FLIGHT: gl.constexpr):
        """out[64 rows, 16] = W_tile (MMA layout, unscaled) @ X^T, two 32-code groups a K step."""
        NB: gl.constexpr = 4  # 16-row blocks: one a warp
        word_l: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 32, 1], [4, 1, 1], [2, 1, 0])  # [block, lane, byte]
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 16, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        x_l: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
        x_s: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, 16], gl.bfloat16)
        blk = gl.program_id(0) * NB + gl.arange(0, NB, layout=gl.SliceLayout(1, gl.SliceLayout(2, word_l)))
        lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, word_l)))
        byte = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, word_l)))
        offs = gl.expand_dims(gl.expand_dims(blk * 16 * stride_wn, 1), 2) \
            + gl.expand_dims(gl.expand_dims(lane * 8, 0), 2) + gl.expand_dims(gl.expand_dims(byte, 0), 1)
        xk = gl.arange(0, 32, layout=gl.SliceLayout(1, x_l))
        xt = gl.arange(0, 16, layout=gl.SliceLayout(0, x_l))
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [2, 32, 16], x_s)
        acc = gl.zeros([64, 16], gl.float32, layout=mma_l)
        for k0 in range(0, K, 64):
            for g in gl.static_range(2):
                kk = k0 + 32 * g
                packed = gl.load(W + offs + (kk // 32) * 256)
                lo, hi = gl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [packed], dtype=(gl.bfloat16, gl.bfloat16),
                                                   is_pure=True, pack=4)
                w = gl.join(lo, hi).reshape([NB, 8, 4, 2, 2, 2, 2]).permute([0, 4, 1, 3, 6, 2, 5]).reshape([64, 32])
                w = gl.convert_layout(w, a_l, assert_trivial=True)  # 1.: no data movement, or no compile
                x_smem.index(g).store(gl.load(X + gl.expand_dims(xt, 0) * stride_xt + gl.expand_dims(kk + xk, 1)))
                fence_async_shared()
                acc = warpgroup_mma(w, x_smem.index(g), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=IN_FLIGHT, deps=[acc])
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
    sig = {"W": "*u8", "X": "*bf16", "OUT": "*fp32", "K": "i32", "stride_wn": "i32", "stride_xt": "i32",
           "ASM": "constexpr", "IN_FLIGHT": "constexpr"}
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names[:6]}
    src = GluonASTSource(fn=_probe_kernel, signature=sig, constexprs={"ASM": _E2M1_WORD_TO_BF16_ASM.value,
                                                                       "IN_FLIGHT": 1}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    total, ops = hottest_loop_mix(kernel)
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", sass_text(kernel))
    print(f"Triton {triton.__version__}: the MMA-layout tile converted trivially (assert_trivial compiled); "
          f"{registers(kernel)} registers; K step (2 groups, 64 rows x 64 codes) {total} instructions: "
          f"{', '.join(f'{k} {v}' for k, v in ops.most_common(8))}; wgmma waits leave in flight: {waits}")


if __name__ == "__main__":
    main()

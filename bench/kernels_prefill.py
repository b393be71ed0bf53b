"""The memory-bound kernels of a prefill step at prefill sizes, on the GPU ([gpu-kernels]; not a CI
test): KDA's short conv + SiLU and its gated output norm under variants of their tiles, and the
router's logits GEMM (fp32 upcasts vs the opt-in bf16 tensor cores with fp32 output). Each variant is
checked against its torch reference on fresh random inputs before it is timed; the table gives
time and the fraction of the copy (or matmul) ceiling measured in the same run.

The kimi-linear-48b 8K-token prefill profile (RESULTS.md, sixteenth session) showed the short conv
at ~0.45 ms a layer (~21 % of copy on its bytes) and the gated norm at ~0.29 ms (~16 %).

Usage: python -m bench.kernels_prefill [--tokens 8192]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
import triton

from bench.ceilings import copy_tbs, matmul_tflops
from bench.compare import rel
from bench.overrides import restore, set_constants
from bench.timing import gpu_ms
from k3serve.model.batch import ForwardBatch, SeqChunk
from k3serve.model.layers import rms_norm
from k3serve.ops import moe_triton, norm_triton, short_conv_triton
from k3serve.ops.short_conv import l2norm_heads, short_conv_ref

DEV = os.environ.get("K3SERVE_CHECK_DEVICE", "cuda")  # cpu: a smoke run through the interpreter (--tokens 64)
# (rows, rows loaded at once, block_c, warps, channels_first, fast_silu) of the stencil (a row-sliding window
# since the thirty-eighth session; its first split form's best, 32 x 128 tiles at 4 warps, was 55-62 % of copy;
# the sweep there kept 32 rows, 8 at once, 512 lanes, 4 warps).
CONV_TILES = ((32, 8, 512, 4, True, True), (32, 8, 512, 4, True, False), (32, 8, 512, 4, False, True),
              (32, 4, 512, 4, True, True), (32, 16, 512, 4, True, True), (64, 8, 512, 4, True, True),
              (16, 8, 512, 4, True, True), (32, 8, 256, 2, True, True), (32, 4, 256, 2, True, True),
              (32, 8, 1024, 4, True, True), (32, 4, 1024, 4, True, True), (32, 8, 256, 1, True, True))
CONV_DEFAULT = (short_conv_triton.CONV_ROWS, short_conv_triton.CONV_GROUP, short_conv_triton.CONV_BLOCK_C,
                short_conv_triton.CONV_WARPS)
NORM_TILES = (0, 1024, 2048, 4096)  # rows a program = tile // 128; 0: one row a program (the old kernel)


def _ms(fn) -> float:
    return gpu_ms(fn) if DEV == "cuda" else (fn(), float("nan"))[1]


def conv_rows(T: int, C: int, copy: float, g: torch.Generator) -> list[str]:
    """Four prompts of T/4 tokens, two of them on cached context (the state path taken)."""
    q = T // 4
    chunks = [SeqChunk([0] * q, ctx, slot, list(range(-(-(q + ctx) // 64)))) for slot, ctx in enumerate((0, 100, 0, 3))]
    batch = ForwardBatch.build(chunks, 64, DEV)
    x = torch.randn(T, C + 336, device=DEV, generator=g).bfloat16()[:, :C]  # a split of the fused in_proj
    w = torch.randn(C, 4, device=DEV, generator=g) * 0.5
    state0 = torch.randn(6, C, 3, device=DEV, generator=g).bfloat16()
    ref_state = state0.clone()
    ref = F.silu(short_conv_ref(x, w, ref_state, batch).float())
    out = []
    conv = "k3serve.ops.short_conv_triton."
    for bt, grp, bc, warps, first, fast in CONV_TILES if DEV == "cuda" else CONV_TILES[:1]:  # (the interpreter: one)
        saved = set_constants(f"{conv}CONV_ROWS={bt},{conv}CONV_GROUP={grp},{conv}CONV_BLOCK_C={bc},{conv}CONV_WARPS={warps},"
                              f"{conv}CONV_CHANNELS_FIRST={first},{conv}CONV_FAST_SILU={fast}")
        state = state0.clone()
        planes = short_conv_triton.short_conv_triton(x, w, state, batch, plane=C // 3)
        err = rel(planes.transpose(0, 1).reshape(T, C).float(), ref)
        ok = err < 2e-2 and torch.equal(state, ref_state)
        ms = _ms(lambda: short_conv_triton.short_conv_triton(x, w, state0.clone(), batch, plane=C // 3))
        restore(saved)
        gb = 2 * T * C * 2 / 1e9  # read x once, write the planes once
        flags = "".join(f", {f}" for f, on in (("channels first", first), ("fast SiLU", fast)) if on)
        out.append(f"| short conv + SiLU | T={T} C={C} | {bt} rows ({grp} at once) x {bc} lanes, {warps} warps{flags} | {ms:.4f} | "
                   f"{100 * gb / ms / copy:.0f} % | {'ok' if ok else f'FAIL rel {err:.1e}'} |")
    # q and k L2-normalised in the conv (kda.CONV_NORMS_QK: tiles one head of 128 wide) vs fla's two
    # l2norm launches on the conv's q and k planes (what chunk_kda runs otherwise)
    ref_n = l2norm_heads(ref, 2 * C // 3, 128)
    norm_tiles = (CONV_DEFAULT, (32, 4, 512, 4), (32, 8, 256, 2), (32, 4, 1024, 4), (32, 16, 512, 4), (16, 8, 512, 4),
                  (16, 16, 512, 4))
    for bt, grp, bc, warps in norm_tiles if DEV == "cuda" else norm_tiles[:1]:
        saved = set_constants(f"{conv}CONV_ROWS={bt},{conv}CONV_GROUP={grp},{conv}CONV_BLOCK_C={bc},{conv}CONV_WARPS={warps}")
        normed = lambda: short_conv_triton.short_conv_triton(x, w, state0.clone(), batch, plane=C // 3,  # noqa: E731
                                                             norm=(2 * C // 3, 128))
        err = rel(normed().transpose(0, 1).reshape(T, C).float(), ref_n)
        ms = _ms(normed)
        restore(saved)
        gb = 2 * T * C * 2 / 1e9
        out.append(f"| short conv + SiLU + q/k L2 norm | T={T} C={C} | {bt} rows ({grp} at once) x {bc} lanes, {warps} warps "
                   f"| {ms:.4f} | {100 * gb / ms / copy:.0f} % | {'ok' if err < 2e-2 else f'FAIL rel {err:.1e}'} |")
    try:
        from fla.modules.norm.l2norm import l2norm_fwd

        planes = short_conv_triton.short_conv_triton(x, w, state0.clone(), batch, plane=C // 3)
        q, k = (p.view(T, -1, 128) for p in planes[:2])
        ms = _ms(lambda: (l2norm_fwd(q), l2norm_fwd(k)))
        out.append(f"| fla l2norm_fwd on q and k | T={T} C={2 * C // 3} | two launches | {ms:.4f} | "
                   f"{100 * 2 * T * 2 * C // 3 * 2 / 1e9 / ms / copy:.0f} % | - |")
    except ImportError:
        pass
    return out


def norm_rows(T: int, H: int, D: int, copy: float, g: torch.Generator) -> list[str]:
    x = torch.randn(T, H, D, device=DEV, generator=g).bfloat16()
    w = torch.rand(D, device=DEV, generator=g) + 0.5
    gate = torch.randn(T, H * D + 256, device=DEV, generator=g).bfloat16()[:, 128:128 + H * D]
    ref = rms_norm(x.float(), w, 1e-6, torch.float32) * torch.sigmoid(gate.float().view(T, H, D))
    out = []
    for tile in NORM_TILES:
        many = 1 if tile else 1 << 62
        saved = set_constants(f"k3serve.ops.norm_triton.NORM_TILE={tile or 1},k3serve.ops.norm_triton.NORM_MANY_ROWS={many}")
        err = rel(norm_triton.rms_norm_triton(x, w, 1e-6, torch.bfloat16, gate=gate).float(), ref)
        ms = _ms(lambda: norm_triton.rms_norm_triton(x, w, 1e-6, torch.bfloat16, gate=gate))
        rows = norm_triton._rows_per_program(T * H, triton.next_power_of_2(D))
        restore(saved)
        gb = 3 * x.numel() * 2 / 1e9
        out.append(f"| gated RMSNorm | T={T} H={H} D={D} | {rows} rows a program | {ms:.4f} | "
                   f"{100 * gb / ms / copy:.0f} % | {'ok' if err < 1e-2 else f'FAIL rel {err:.1e}'} |")
    return out


def router_rows(T: int, E: int, D: int, mm: float, g: torch.Generator) -> list[str]:
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    w = (torch.randn(E, D, device=DEV, generator=g) * D ** -0.5).bfloat16()
    ref = F.linear(x.double(), w.double())
    tf = 2 * T * E * D / 1e12
    out = []
    for name, flag, tol in (("fp32 GEMM of upcasts (default)", None, 1e-6),
                            ("cuBLAS bf16 MMA, fp32 out (ROUTER_PREFILL_MMA)", "ROUTER_PREFILL_MMA", 3e-5),
                            ("ours: MMA per chunk, fp32 sums (ROUTER_PREFILL_KERNEL)", "ROUTER_PREFILL_KERNEL", 1e-6)):
        saved = set_constants(f"k3serve.ops.moe_triton.{flag}=True" if flag else "")
        err = rel(moe_triton.router_logits(x, w), ref)
        ms = _ms(lambda: moe_triton.router_logits(x, w))
        restore(saved)
        out.append(f"| router logits | T={T} E={E} D={D} | {name} | {ms:.4f} | {100 * tf / (ms / 1e3) / mm:.0f} % of "
                   f"matmul | {'ok' if err < tol else 'FAIL'} rel {err:.1e} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    T = ap.parse_args().tokens
    copy, mm = (copy_tbs(), matmul_tflops()) if DEV == "cuda" else (1.0, 1.0)
    g = torch.Generator(device=DEV).manual_seed(0)
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else DEV}: copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s\n")
    print("| kernel | shape | variant | ms | % of ceiling | check |\n|---|---|---|---|---|---|")
    with torch.inference_mode():
        rows = (conv_rows(T, 3 * 32 * 128, copy, g) + conv_rows(T, 3 * 96 * 128, copy, g)
                + norm_rows(T, 32, 128, copy, g) + norm_rows(T, 96, 128, copy, g)
                + router_rows(T, 256, 2304, mm, g) + router_rows(T, 896, 7168, mm, g))
    print("\n".join(rows))


if __name__ == "__main__":
    main()

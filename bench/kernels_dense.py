"""Skinny dense GEMMs of a kimi-linear decode step: cuBLAS (F.linear) next to our grouped GEMM run
as one "expert" (swap-AB tiles put the weight on the MMA's M side, the handful of tokens on N),
at 1 / 4 / 16 / 64 tokens, as weight TB/s and % of the copy ceiling measured in the same run.
A decode step at batch 1 spends ~1.1 ms in cuBLAS GEMMs whose weights take ~0.7 ms at the
ceiling (RESULTS.md seventh session); this says whether a Triton path would be worth routing
them through. Every variant is checked against F.linear first. Not a CI test.

Usage (device): python -m bench.kernels_dense
"""

import torch
import torch.nn.functional as F

from bench.ceilings import copy_tbs
from bench.timing import gpu_ms

from k3serve.ops.moe_triton import grouped_gemm

# (name, in, out): KDA fused input projection (q|k|v, f_a|g_a, b), KDA / MLA o_proj, the MLA
# query projection, the dense MLP of layer 0 (gate|up, down), the LM head.
SHAPES = [("kda in_proj", 2304, 3 * 4096 + 2 * 128 + 32), ("o_proj", 4096, 2304), ("mla q_proj", 2304, 32 * 192),
          ("dense gate|up", 2304, 2 * 9216), ("dense down", 9216, 2304), ("lm_head", 2304, 163840)]
TILES = [(32, True, 2, 4), (64, True, 4, 3), (128, True, 4, 3), (64, False, 4, 3), (128, False, 8, 3)]


def ours(x, w, tiles):
    M = x.shape[0]
    rows = torch.full((-(-M // 16) * 16,), M, dtype=torch.int64, device=x.device)
    rows[:M] = torch.arange(M, device=x.device)
    blocks = torch.zeros(rows.numel() // 16, dtype=torch.int64, device=x.device)
    bn, swap, nw, st = tiles
    return grouped_gemm(x, rows, blocks, M, 1, w[None], None, w.shape[0], 16, out_dtype=torch.bfloat16,
                        tiles=dict(BLOCK_N=bn, SWAP_AB=swap, num_warps=nw, num_stages=st))


def main():
    ceil = copy_tbs()
    print(f"copy ceiling {ceil:.2f} TB/s")
    print("| GEMM | tokens | cuBLAS ms | cuBLAS % copy | best ours ms (tile) | ours % copy | rel err |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, k, n in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        for M in (1, 4, 16, 64):
            x = torch.randn(M, k, device="cuda", generator=g).bfloat16()
            ref = F.linear(x, w)
            gb = n * k * 2 / 1e9
            t_cublas = gpu_ms(lambda: F.linear(x, w), rep=100)
            best = None
            for tiles in TILES:
                try:
                    err = ((ours(x, w, tiles).float() - ref.float()).norm() / ref.float().norm()).item()
                    ms = gpu_ms(lambda: ours(x, w, tiles), rep=100)
                except Exception as exc:  # a tile that does not fit
                    print(f"| {name} | {M} | tile {tiles} failed: {type(exc).__name__} ||||||")
                    continue
                if best is None or ms < best[0]:
                    best = (ms, tiles, err)
            pct = lambda ms: 100 * gb / ms / ceil  # noqa: E731  (GB / ms = TB/s)
            print(f"| {name} | {M} | {t_cublas:.4f} | {pct(t_cublas):.0f} % | {best[0]:.4f} {best[1]} | "
                  f"{pct(best[0]):.0f} % | {best[2]:.1e} |", flush=True)


if __name__ == "__main__":
    main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")

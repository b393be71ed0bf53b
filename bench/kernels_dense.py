"""Skinny dense GEMMs of a kimi-linear decode step at 1 / 2 / 4 tokens: cuBLAS (F.linear) next to
our split-K GEMV (ops/gemv_triton.py: autotuned as the model calls it, and its best pinned tile),
as weight TB/s and % of the copy ceiling measured in the same run, every kernel timed by CUDA-graph
replay with a cold L2 (bench/timing.py). Each GEMV is checked against F.linear first. (The
grouped MoE GEMM run as one expert lost to cuBLAS on every shape: RESULTS.md eighth session.)
Not a CI test.

Usage (device): python -m bench.kernels_dense [--batched]
  --batched: the batched GEMV at the model's per-head / per-gate shapes (KDA f|g up-projections,
  MLA query absorption, MLA W_UV in fp32) next to the torch ops it replaced, and its tiles.
"""

import sys

import torch
import torch.nn.functional as F

from bench.ceilings import copy_tbs
from bench.timing import gpu_ms

from k3serve.ops.gemv_triton import GEMV_CONFIGS, _gemv_tuned, gemv

# (name, in, out): KDA fused input projection (q|k|v, f_a|g_a, b), KDA / MLA o_proj, the MLA
# query projection, the dense MLP of layer 0 (gate|up, down), the LM head.
SHAPES = [("kda in_proj", 2304, 3 * 4096 + 2 * 128 + 32), ("o_proj", 4096, 2304), ("mla q_proj", 2304, 32 * 192),
          ("dense gate|up", 2304, 2 * 9216), ("dense down", 9216, 2304), ("lm_head", 2304, 163840)]
# (name, batch, in, out, fp32 activations): per-batch weights [B, out, in] in bf16
BATCHED_SHAPES = [("kda f|g up", 2, 128, 4096, False), ("mla q absorb", 32, 128, 512, False),
                  ("mla W_UV (fp32 x)", 32, 512, 128, True)]


def gemv_times(x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, label: str):
    """(worst rel err vs ``ref``, tuned ms, tuned tile, (best ms, best tile)): the GEMV autotuned as
    the model calls it, then every pinned tile (each checked too)."""
    rel = lambda y: ((y.float() - ref).norm() / ref.norm()).item()  # noqa: E731
    err = rel(gemv(x, w))
    t_tuned = gpu_ms(lambda: gemv(x, w), rep=100)
    c = _gemv_tuned.best_config
    tuned = f"{c.kwargs['BLOCK_N']},{c.kwargs['BLOCK_K']},{c.kwargs['SPLIT_K']},{c.num_warps},{c.num_stages}"
    best = None
    for c in GEMV_CONFIGS:
        cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        try:
            err = max(err, rel(gemv(x, w, cfg)))
            ms = gpu_ms(lambda: gemv(x, w, cfg), rep=100)
        except Exception as exc:  # a tile that does not fit
            print(f"| {label} | tile {cfg} failed: {type(exc).__name__} |")
            continue
        if best is None or ms < best[0]:
            best = (ms, tuple(cfg.values()))
    return err, t_tuned, tuned, best


def batched() -> None:
    ceil = copy_tbs()
    print(f"copy ceiling {ceil:.2f} TB/s")
    print("| op | B | tokens | torch ms | torch % copy | GEMV tuned ms | % copy | tuned tile | best tile ms (tile) | "
          "rel err |\n|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, B, k, n, fp32_x in BATCHED_SHAPES:
        w = (torch.randn(B, n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        w32 = w.float()
        for M in (1, 4):
            x = torch.randn(M, B, k, device="cuda", generator=g).transpose(0, 1)
            x = x if fp32_x else x.bfloat16()
            torch_op = ((lambda: torch.einsum("bti,boi->bto", x, w32)) if fp32_x  # the fp32 copy the model kept
                        else (lambda: torch.bmm(x, w.transpose(1, 2))))
            gb = B * n * k * 2 / 1e9
            pct = lambda ms: 100 * gb / ms / ceil  # noqa: E731
            t_torch = gpu_ms(torch_op, rep=100)
            err, t_tuned, tuned, best = gemv_times(x, w, torch_op().float(), f"{name} | {B} | {M}")
            print(f"| {name} | {B} | {M} | {t_torch:.4f} | {pct(t_torch):.0f} % | {t_tuned:.4f} | {pct(t_tuned):.0f} % "
                  f"| {tuned} | {best[0]:.4f} {best[1]} | {err:.1e} |", flush=True)


def main():
    ceil = copy_tbs()
    print(f"copy ceiling {ceil:.2f} TB/s")
    print("| GEMM | tokens | cuBLAS ms | cuBLAS % copy | GEMV tuned ms | % copy | tuned tile | best GEMV ms (tile) | "
          "% copy | rel err |\n|---|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, k, n in SHAPES:
        w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).bfloat16()
        for M in (1, 2, 4):
            x = torch.randn(M, k, device="cuda", generator=g).bfloat16()
            gb = n * k * 2 / 1e9
            pct = lambda ms: 100 * gb / ms / ceil  # noqa: E731  (GB / ms = TB/s)
            t_cublas = gpu_ms(lambda: F.linear(x, w), rep=100)
            err, t_tuned, tuned, best = gemv_times(x, w, F.linear(x, w).float(), f"{name} | {M}")
            print(f"| {name} | {M} | {t_cublas:.4f} | {pct(t_cublas):.0f} % | {t_tuned:.4f} | {pct(t_tuned):.0f} % | "
                  f"{tuned} | {best[0]:.4f} {best[1]} | {pct(best[0]):.0f} % | {err:.1e} |", flush=True)


if __name__ == "__main__":
    batched() if "--batched" in sys.argv else main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")

"""Where the split AttnRes mixer's time goes ([gpu-kernels]; GPU only): each program's global-timer
stamps (start, arrival at the barrier, past it, end; ``_attn_res_split_kernel``'s TRACE) after a
cold L2, relative to the earliest start, medians over launches. Tells the barrier's wait (the
slowest arrival against the others) from the programs' own work.

Usage: python3 bench/attn_res_trace.py [SOURCES [TOKENS]]
"""

from __future__ import annotations

import sys

import torch

from k3serve.ops import attn_res_triton


def main() -> None:
    M = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    D = 7168
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(M, T, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(D, device="cuda", generator=g)
    w = torch.rand(D, device="cuda", generator=g).bfloat16()
    shape = attn_res_triton.split_shape(M, D, T, src.device) or dict(COLS=256, SPLIT=28)
    n = shape["SPLIT"]
    out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    trace = torch.zeros(T * n * 4, dtype=torch.int64, device="cuda")
    flush = torch.ones(32 << 20, device="cuda")
    part = attn_res_triton.split_parts(T, shape, src.device)
    runs = []
    for _ in range(30):
        flush.sum()
        attn_res_triton.launch_split(src, q, 1e-5, w, out, src[0], shape, part, trace=trace)
        torch.cuda.synchronize()
        stamps = trace.view(T * n, 4).double()
        runs.append((stamps - stamps[:, 0].min()) / 1e3)  # us since the earliest start
    med = torch.stack(runs[5:]).median(0).values  # [programs, 4]
    print(f"{M} sources x {T} tokens x {D}, {n} programs a token ({shape['COLS']} columns); us since the first start, "
          "median of 25 launches\n\n| stamp | first program | median program | last program |\n|---|---|---|---|")
    for i, name in enumerate(("start", "arrival", "past the barrier", "end")):
        col = med[:, i].sort().values
        print(f"| {name} | {col[0]:.2f} | {col[len(col) // 2]:.2f} | {col[-1]:.2f} |")
    wait = med[:, 2] - med[:, 1]
    print(f"\nwait at the barrier: median {wait.median():.2f} us, the last arrival's {wait[med[:, 1].argmax()]:.2f}; "
          f"own work before it (arrival - start): median {(med[:, 1] - med[:, 0]).median():.2f} us; after it (end - past): "
          f"median {(med[:, 3] - med[:, 2]).median():.2f} us")


if __name__ == "__main__":
    main()

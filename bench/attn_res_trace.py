"""Where an AttnRes mixer's time goes ([gpu-kernels]; GPU only): each program's global-timer stamps
after a cold L2, relative to the earliest start, medians over launches. The split mixer
(``_attn_res_split_kernel``'s TRACE: start, arrival at the barrier, past it, end) tells the
barrier's wait from the programs' own work; ``--token``, the program-a-token mixer
(``_attn_res_kernel``'s: past the PDL wait, the scores, the mix with the partial stored, the end)
tells its loads and reductions from its tail.

``--summary Q``: the split kernel as a block summary (SOURCES blocks, Q queries).

Usage: python3 bench/attn_res_trace.py [--token | --summary Q] [SOURCES [TOKENS]]
"""

from __future__ import annotations

import sys

import torch

from k3serve.ops import attn_res_triton


def main() -> None:
    token = "--token" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--token"]
    queries = 0
    if "--summary" in args:
        i = args.index("--summary")
        queries = int(args.pop(i + 1))
        args.pop(i)
    M = int(args[0]) if args else (5 if token else 9)
    T = int(args[1]) if len(args) > 1 else 1
    D = 7168
    g = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(M, T, D, device="cuda", generator=g).bfloat16()
    delta = torch.randn(T, D, device="cuda", generator=g).bfloat16()
    q = torch.randn(D, device="cuda", generator=g)
    w = torch.rand(D, device="cuda", generator=g).bfloat16()
    out = torch.empty(T, D, dtype=torch.bfloat16, device="cuda")
    if token:
        n, what, names = 1, "a program a token", ("past the wait", "scores", "mix, partial stored", "end")
        trace = torch.zeros(T * 4, dtype=torch.int64, device="cuda")
        launch = lambda: attn_res_triton.launch_token(src, q, 1e-5, w, out, delta, True, False, trace=trace)  # noqa: E731
    else:
        shape = attn_res_triton.split_shape(M, D, T, src.device) or dict(COLS=256, SPLIT=28)
        n, names = shape["SPLIT"], ("start", "arrival", "past the barrier", "end")
        what = f"{n} programs a token ({shape['COLS']} columns)"
        trace = torch.zeros(T * n * 4, dtype=torch.int64, device="cuda")
        part = attn_res_triton.split_parts(T, shape, src.device, queries)
        summary = None
        if queries:
            what += f", a block summary for {queries} queries"
            q = torch.randn(queries, D, device="cuda", generator=g)
            summary = (torch.empty(queries, T, 2, D, dtype=src.dtype, device="cuda"),
                       torch.empty(queries, T, device="cuda"))
        launch = lambda: attn_res_triton.launch_split(src, q, 1e-5, w, out, src[0], shape, part, trace=trace,  # noqa: E731
                                                      summary=summary)
    flush = torch.ones(32 << 20, device="cuda")
    runs = []
    for _ in range(30):
        flush.sum()
        launch()
        torch.cuda.synchronize()
        stamps = trace.view(T * n, 4).double()
        runs.append((stamps - stamps[:, 0].min()) / 1e3)  # us since the earliest start
    med = torch.stack(runs[5:]).median(0).values  # [programs, 4]
    print(f"{M} sources x {T} tokens x {D}, {what}; us since the first start, median of 25 launches\n\n"
          "| stamp | first program | median program | last program |\n|---|---|---|---|")
    for i, name in enumerate(names):
        col = med[:, i].sort().values
        print(f"| {name} | {col[0]:.2f} | {col[len(col) // 2]:.2f} | {col[-1]:.2f} |")
    if not token:
        wait = med[:, 2] - med[:, 1]
        print(f"\nwait at the barrier: median {wait.median():.2f} us, the last arrival's {wait[med[:, 1].argmax()]:.2f}; "
              f"own work before it (arrival - start): median {(med[:, 1] - med[:, 0]).median():.2f} us; after it "
              f"(end - past): median {(med[:, 3] - med[:, 2]).median():.2f} us")


if __name__ == "__main__":
    main()

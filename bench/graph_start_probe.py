"""What a CUDA graph's start costs after what precedes it on the stream (fifty-second session).

The engine's batch-1 step idles ~21 us between the inputs' host-to-device copy and the decode
graph's first kernel, whatever sits between them (a device copy or nothing: RESULTS.md). This
times a chain of small dependent kernels replayed as one graph, preceded each step by nothing, a
pinned host-to-device copy, a kernel, or a device-to-host copy and an upload (the engine's step
boundary), with the upload outside the graph or captured into it, or read by the graph's first
kernel straight from pinned host memory (no copy at all). Per step: GPU time (events over many
steps; the host is far ahead) minus the graph alone, and the profiler's gap before the graph's
first kernel.

    python3 -m bench.graph_start_probe --nodes 30,300
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl


@triton.jit
def _bump_kernel(x_ptr, src_ptr, n, BLOCK: tl.constexpr):
    """x[i] += 1 + src[i % 8] (src: device or pinned host memory)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs % 8)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0 + v.to(tl.float32), mask=mask)


def bump(x: torch.Tensor, src: torch.Tensor) -> None:
    _bump_kernel[(triton.cdiv(x.numel(), 1024),)](x, src, x.numel(), BLOCK=1024)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="30,300")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(1 << 16, device=dev)  # 256 KB: each kernel ~2 us
    host = torch.arange(4096, dtype=torch.int64).pin_memory()  # 32 KB of "inputs"
    host_out = torch.empty(64, dtype=torch.int64).pin_memory()
    dbuf = torch.zeros(4096, dtype=torch.int64, device=dev)
    small = torch.zeros(64, dtype=torch.int64, device=dev)
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        def chain(first_src):
            bump(x, first_src)
            for _ in range(nodes - 1):
                bump(x, dbuf)

        bodies = {"plain": lambda: chain(dbuf),  # (the upload captured last: a refused capture may spoil the stream)
                  "zero-copy read": lambda: chain(host),
                  "upload captured": lambda: (dbuf.copy_(host, non_blocking=True), chain(dbuf))}
        graphs = {}
        for name, body in bodies.items():
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    body()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    body()
                graphs[name] = g
            except Exception as exc:  # (a form the runtime refuses is a finding too)
                rows.append({"nodes": nodes, "variant": name, "error": str(exc)[:200]})
                torch.cuda.synchronize()
        before = {"nothing": lambda: None,
                  "upload": lambda: dbuf.copy_(host, non_blocking=True),
                  "kernel": lambda: small.add_(1),
                  "tokens back + upload": lambda: (host_out.copy_(small, non_blocking=True),
                                                   dbuf.copy_(host, non_blocking=True))}
        plans = [(g, b) for g in graphs for b in before if g == "plain" or b in ("nothing", "kernel")]
        for gname, bname in plans:
            g, pre = graphs[gname], before[bname]
            for _ in range(20):
                pre()
                g.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(args.steps):
                pre()
                g.replay()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) * 1e3 / args.steps
            gap = first_kernel_gap(pre, g, nodes)
            rows.append({"nodes": nodes, "graph": gname, "before it": bname, "us a step": round(us, 2),
                         "first kernel gap us": gap})
            print(json.dumps(rows[-1]), flush=True)
    base = {r["nodes"]: r["us a step"] for r in rows if r.get("graph") == "plain" and r["before it"] == "nothing"}
    print("\n| nodes | graph | before it | us a step | + vs plain graph alone | gap before first kernel us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['nodes']} | {r['variant']} | - | refused: {r['error']} | | |")
        else:
            print(f"| {r['nodes']} | {r['graph']} | {r['before it']} | {r['us a step']} | "
                  f"{r['us a step'] - base[r['nodes']]:+.2f} | {r['first kernel gap us']} |")


def first_kernel_gap(pre, g, nodes: int, steps: int = 30) -> float | None:
    """Median gap (us) between the end of the GPU work before each replay and its first kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            pre()
            g.replay()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, reach, run = [], None, 0
    for start, end, name in events:
        if "_bump_kernel" in name:
            if run == 0 and reach is not None:
                gaps.append(start - reach)
            run = (run + 1) % nodes
        reach = end if reach is None else max(reach, end)
    gaps.sort()
    return round(gaps[len(gaps) // 2], 2) if gaps else None


if __name__ == "__main__":
    main()

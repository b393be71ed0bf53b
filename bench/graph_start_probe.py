"""What a CUDA graph's start costs after what precedes it on the stream (fifty-second session).

The engine's batch-1 step idles ~21 us between the inputs' host-to-device copy and the decode
graph's first kernel, whatever sits between them (a device copy or nothing: RESULTS.md). This
times a chain of small dependent kernels replayed as one graph, preceded each step by nothing, a
pinned host-to-device copy, a kernel, or a device-to-host copy and an upload (the engine's step
boundary), with the upload outside the graph or captured into it, or read by the graph's first
kernel straight from pinned host memory (no copy at all); and (fifty-third session) with both copies
on side streams: the upload into one of two device staging buffers, which a kernel then copies
into the graph's inputs once an event says it arrived, and the tokens read back after an event
recorded behind the sampler's stand-in kernel. Per step: GPU time (events over many
steps; the host is far ahead) minus the graph alone, and the profiler's gap before the graph's
first kernel.

    python3 -m bench.graph_start_probe --nodes 30,300
    python3 -m bench.graph_start_probe --nodes "" --real kimi-linear-48b   # the model's own decode graph
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from k3serve.engine.transfer import copy_staged


@triton.jit
def _bump_kernel(x_ptr, src_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """x[i] += 1 + src[i % 8] (src: device or pinned host memory)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(src_ptr + offs % 8)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0 + v.to(tl.float32), mask=mask)


def bump(x: torch.Tensor, src: torch.Tensor, pdl: bool = False) -> None:
    extra = {"USE_PDL": True, "launch_pdl": True} if pdl else {}
    _bump_kernel[(triton.cdiv(x.numel(), 1024),)](x, src, x.numel(), BLOCK=1024, **extra)


class SideCopies:
    """The step boundary with its copies on a second stream: before each replay the upload goes into
    staging buffer i % 2 (once the kernel that last read it is done), the compute stream waits for it
    and copies it in by a kernel; optionally the sampler's stand-in kernel runs first and its tokens
    go back to the host from the side stream."""

    def __init__(self, host: torch.Tensor, dbuf: torch.Tensor, small: torch.Tensor, host_out: torch.Tensor,
                 tokens_back: bool, upload: bool = True):
        self.host, self.dbuf, self.small, self.host_out = host, dbuf, small, host_out
        self.stage = [torch.zeros_like(dbuf) for _ in range(2)]
        self.side, self.back = torch.cuda.Stream(), torch.cuda.Stream()  # (one stream: the upload would queue
        # behind the read-back, which waits for the sampler)
        self.arrived = [torch.cuda.Event() for _ in range(2)]
        self.read = [torch.cuda.Event() for _ in range(2)]
        self.sampled = torch.cuda.Event()
        self.tokens_back, self.upload, self.i = tokens_back, upload, 0

    def __call__(self) -> None:
        cur = torch.cuda.current_stream()
        if self.tokens_back:
            self.small.add_(1)  # the sampler
            self.sampled.record(cur)
            self.back.wait_event(self.sampled)
            with torch.cuda.stream(self.back):
                self.host_out.copy_(self.small, non_blocking=True)
        if not self.upload:
            self.dbuf.copy_(self.host, non_blocking=True)
            return
        s, self.i = self.i % 2, self.i + 1
        self.side.wait_event(self.read[s])
        with torch.cuda.stream(self.side):
            self.stage[s].copy_(self.host, non_blocking=True)
            self.arrived[s].record(self.side)
        cur.wait_event(self.arrived[s])
        copy_staged(self.dbuf, self.stage[s], self.dbuf.numel(), 0, self.dbuf)  # (the engine's kernel)
        self.read[s].record(cur)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="30,300")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--real", default="", help="also a model preset's batch-1 decode graph (e.g. kimi-linear-48b)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    x = torch.zeros(1 << 16, device=dev)  # 256 KB: each kernel ~2 us
    host = torch.arange(4096, dtype=torch.int64).pin_memory()  # 32 KB of "inputs"
    host_out = torch.empty(64, dtype=torch.int64).pin_memory()
    dbuf = torch.zeros(4096, dtype=torch.int64, device=dev)
    small = torch.zeros(64, dtype=torch.int64, device=dev)
    rows = []
    for nodes in [int(n) for n in args.nodes.split(",") if n]:
        def chain(first_src, pdl=False):
            bump(x, first_src)
            for _ in range(nodes - 1):
                bump(x, dbuf, pdl)

        bodies = {"plain": lambda: chain(dbuf),  # (the upload captured last: a refused capture may spoil the stream)
                  "PDL launches": lambda: chain(dbuf, pdl=True),
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
                                                   dbuf.copy_(host, non_blocking=True)),
                  "sampler, tokens back, upload, device copy (the engine)": lambda: (
                      small.add_(1), host_out.copy_(small, non_blocking=True), dbuf.copy_(host, non_blocking=True),
                      dbuf[:64].copy_(small, non_blocking=True)),
                  "side upload + copy kernel": SideCopies(host, dbuf, small, host_out, tokens_back=False),
                  "sampler, side tokens back, upload": SideCopies(host, dbuf, small, host_out, tokens_back=True,
                                                                 upload=False),
                  "sampler, side tokens back, side upload + copy kernel": SideCopies(host, dbuf, small, host_out,
                                                                                    tokens_back=True)}
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
    if args.real:
        rows += real_graph(args.real, args.steps)
    base = {r["nodes"]: r["us a step"] for r in rows if r.get("graph") == "plain" and r["before it"] == "nothing"}
    base.update({r["nodes"]: r["us a step"] for r in rows if r.get("graph") == "model, one graph"
                 and r["before it"] == "nothing"})
    print("\n| nodes | graph | before it | us a step | + vs plain graph alone | gap before first kernel us |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["nodes"] not in base:
            print(f"| {r['nodes']} | {r['graph']} | {r['before it']} | {r['us a step']} | | {r['first kernel gap us']} |")
        elif "error" in r:
            print(f"| {r['nodes']} | {r['variant']} | - | refused: {r['error']} | | |")
        else:
            print(f"| {r['nodes']} | {r['graph']} | {r['before it']} | {r['us a step']} | "
                  f"{r['us a step'] - base[r['nodes']]:+.2f} | {r['first kernel gap us']} |")


def real_graph(preset: str, steps: int) -> list[dict]:
    """The model's batch-1 decode graph (context 512, dummy weights) replayed: back to back, after a
    kernel, and alternating with a second capture of the same step (does a graph's start wait for
    the previous launch of the same executable graph?)."""
    from bench.gpu_check_graphs import captured_pool
    from k3serve.engine.decode_graphs import capture_graphs
    from k3serve.model.batch import SeqChunk
    from k3serve.model.loader import load_model

    model = load_model(preset=preset, dtype="bfloat16", device="cuda", seed=0, progress=False)
    pool, slots, pages, graphs = captured_pool(model, 2 << 30, 512, 1)
    graphs.run([SeqChunk([7], 512, slots[0], pages[0])])  # the inputs filled
    twin = capture_graphs({1: lambda: graphs._forward(graphs._static_batch(1, [1]))}, "decode")[0][1]
    x, src = torch.zeros(1024, device="cuda"), torch.zeros(8, dtype=torch.int64, device="cuda")
    n_nodes = len(kernel_names(lambda: graphs.graphs[1].replay()))
    rows = []
    for gname, order in (("model, one graph", [graphs.graphs[1]]), ("model, two captures alternating",
                                                                     [graphs.graphs[1], twin])):
        for bname in ("nothing", "kernel", "kernel; after it a kernel, the host waiting for the step before",
                      "kernel; ... and then working 1 ms"):
            state = {"i": 0, "events": [], "launch_s": 0.0}

            def step():
                if bname != "nothing":
                    bump(x, src)  # the inputs' copy kernel
                t0 = time.perf_counter()
                order[state["i"] % len(order)].replay()
                state["launch_s"] += time.perf_counter() - t0
                state["i"] += 1
                if bname.startswith("kernel;"):  # the engine's pattern: sampler, wait for the step before, work
                    bump(x, src)
                    state["events"].append(torch.cuda.Event())
                    state["events"][-1].record()
                    if len(state["events"]) > 1:
                        state["events"].pop(0).synchronize()
                    t1 = time.perf_counter()
                    while "1 ms" in bname and time.perf_counter() - t1 < 1e-3:
                        pass

            for _ in range(10):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(steps):
                step()
            end.record()
            torch.cuda.synchronize()
            state["launch_s"] = 0.0
            gap = first_kernel_gap(step, None, n_nodes, 30, marker=None)
            rows.append({"nodes": f"{preset} ({n_nodes} kernels)", "graph": gname, "before it": bname,
                         "us a step": round(start.elapsed_time(end) * 1e3 / steps, 2),
                         "host us in replay() a step (profiled)": round(state["launch_s"] * 1e6 / 30, 1),
                         "first kernel gap us": gap})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in sorted(prof.events(), key=lambda e: e.time_range.start)
            if e.device_type == torch.autograd.DeviceType.CUDA and _graph_kernel(e.name)]


def _graph_kernel(name: str) -> bool:
    """A kernel of the model's graph (not a copy, a memset, or the probe's own kernel)."""
    return not any(k in name.lower() for k in ("memcpy", "memset", "_bump_kernel"))


def first_kernel_gap(pre, g, nodes: int, steps: int = 30, marker: str | None = "_bump_kernel") -> float | None:
    """Median gap (us) between the end of the GPU work before each replay and its first kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            pre()
            if g is not None:
                g.replay()
        torch.cuda.synchronize()
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    gaps, reach, run = [], None, 0
    for start, end, name in events:
        if (marker in name) if marker else _graph_kernel(name):
            if run == 0 and reach is not None:
                gaps.append(start - reach)
            run = (run + 1) % nodes
        reach = end if reach is None else max(reach, end)
    gaps.sort()
    return round(gaps[len(gaps) // 2], 2) if gaps else None


if __name__ == "__main__":
    main()

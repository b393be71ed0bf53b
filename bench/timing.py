"""Kernel timing for the benches: replayed from a CUDA graph with cold caches, as a decode step runs.

Plain ``triton.testing.do_bench`` launches from Python each time; under ~50 us a kernel then waits
on its own launch (Triton's launcher plus our wrapper cost 20-60 us), so small decode cases timed
the host, not the GPU (eighth session: a 4.7 MB MLA decode "took" 0.25 ms). A bare graph replay
has the opposite fault: the same few MB are re-read from L2 (50 MB on H200) every call, which no
decode step enjoys, since it streams GBs of weights between two visits of a layer. So each call
is preceded by a read of 128 MB (clean lines: no write-back lands in the timed kernel), and a
graph of the reads alone is timed and subtracted."""
import torch

_FLUSH_BYTES = 128 << 20


def _capture(fn, n: int) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return graph


def _replay_ms(graph: torch.cuda.CUDAGraph, budget_ms: float) -> float:
    """Median wall time of one replay, over as many replays as fit the budget (5..50)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    while len(times) < 5 or (len(times) < 50 and sum(times) < budget_ms):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def gpu_ms(fn, rep: int = 100, calls: int = 10, cold: bool = True) -> float:
    """Median milliseconds of one ``fn`` call: ``calls`` calls per graph, each after an L2 flush
    (``cold``), minus the flushes alone. ``fn`` runs once first (compile, autotune) outside the
    capture; one that cannot be captured is timed by plain launches (``do_bench``, which flushes
    too) and reported through ``gpu_ms.eager`` so a table can flag it. ``rep``: ms of replays."""
    fn()
    torch.cuda.synchronize()
    try:
        if cold:
            buf, sink = torch.ones(_FLUSH_BYTES // 4, device="cuda"), torch.empty((), device="cuda")
            flush = lambda: torch.sum(buf, dim=0, out=sink)  # noqa: E731
            body = lambda: (flush(), fn())  # noqa: E731
            base = _replay_ms(_capture(flush, calls), rep)
        else:
            body, base = fn, 0.0
        return max(_replay_ms(_capture(body, calls), rep) - base, 0.0) / calls
    except Exception as exc:  # a host sync or an uncapturable op inside fn
        import triton

        gpu_ms.eager.append(repr(exc)[:160])
        torch.cuda.synchronize()
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


gpu_ms.eager = []


def by_kernel(fn, calls: int = 5) -> list[tuple[str, int, float]]:
    """(kernel name, launches a call, ms a call) of ``fn`` under the profiler, most time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:70], []).append(e.device_time_total / 1e3)
    return sorted(((k, len(v) // calls, sum(v) / calls) for k, v in kernels.items()), key=lambda r: -r[2])

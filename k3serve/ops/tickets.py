"""Split work finished by its last program, in one launch: each program of a group writes its
part, takes a ticket, and the program that draws the last ticket (all the others' writes are
visible to it) does the group's epilogue. Saves the second kernel (and its launch and ramp) that a
split reduction otherwise needs; the epilogue reads the parts in a fixed order, so results do not
depend on which program came last. Where every program needs the group's total (a softmax
over a row split between programs), ``barrier`` is a grid barrier instead: all wait, then all go on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def last_arrival(TICKETS, group, COUNT):
    """True in the last of ``COUNT`` programs of ``group`` to call this; it resets the counter for
    the next launch. The barrier puts all of this program's stores before its acquire-release
    ticket (one thread takes it; release is cumulative), and the winner then sees the others'."""
    tl.debug_barrier()
    ticket = tl.atomic_add(TICKETS + group, 1, sem="acq_rel", scope="gpu")
    last = ticket == COUNT - 1
    if last:
        tl.store(TICKETS + group, 0)
    return last


@triton.jit
def barrier(COUNTS, group, COUNT):
    """Returns in each of ``COUNT`` programs of ``group`` once all of them have called it, every
    store they made before it visible to all: each arrives (release) and spins (acquire) until the
    count reaches the next multiple of COUNT past its own arrival, so the programs must all be
    resident at once (a grid of at most one program an SM). The int64 count only grows: nothing
    resets it, so no atomic round trip runs after the wait (a count reset by a second, leaving
    atomic ended each program a round trip later: RESULTS.md thirtieth session). Every launch on a
    counter must have the same COUNT (so that the count is a multiple of it between launches) and
    the counts must start at zero: ``tickets(..., torch.int64)``, made outside graph captures (one
    made in a capture hung a graph A/B, RESULTS.md twenty-ninth session)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(COUNTS + group, 1, sem="release", scope="gpu")
    target = (arrived // COUNT + 1) * COUNT
    while tl.atomic_add(COUNTS + group, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


_BUFFERS: dict = {}


def tickets(device: torch.device, n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Zeroed int32 counters (at least ``n``; int64: ``barrier``'s growing counts, a buffer of their
    own), one buffer a device and dtype: each ticketed kernel leaves its
    counters at zero, and a device's ticketed kernels run one after another (one compute stream; a
    graph capture's warm-up side stream waits on it, and it on the side stream). Buffers live as
    long as the process (a CUDA graph may hold their address), so a larger need adds one instead of
    replacing it.

    Never made inside a CUDA graph capture: there its zeroing would only be recorded, run when that
    graph replays, and its memory comes from the graph pool, which may hold an earlier capture's
    data, so a graph replayed first would read garbage counts (a barrier that never opens: this
    is how a variant of the AttnRes mixer hung a graph A/B, RESULTS.md twenty-ninth session; with
    one buffer a stream the capture stream's was always made in a capture). Captures warm up
    first (engine/decode_graphs.capture_graphs, bench/timing.py), which makes it; a capture that
    needs a new one is refused."""
    bufs = _BUFFERS.setdefault((device, dtype), [])
    if not bufs or bufs[-1].numel() < n:
        if _capturing(device):
            raise RuntimeError(f"tickets: {n} counters on {device} first asked for inside a CUDA graph capture; "
                               "run the step once outside the capture first")
        bufs.append(torch.zeros(max(n, 1 << 15), dtype=dtype, device=device))
    return bufs[-1]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()

"""Split work finished by its last program, in one launch: each program of a group writes its
part, takes a ticket, and the program that draws the last ticket (all the others' writes are
visible to it) does the group's epilogue. Saves the second kernel (and its launch and ramp) that a
split reduction otherwise needs; the epilogue reads the parts in a fixed order, so results do not
depend on which program came last."""

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


_BUFFERS: dict = {}


def tickets(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 counters (at least ``n``), one buffer per stream: kernels on one stream run one
    after another and each leaves its counters at zero. Buffers live as long as the process (a
    CUDA graph may hold their address), so a larger need adds one instead of replacing it."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    bufs = _BUFFERS.setdefault(key, [])
    if not bufs or bufs[-1].numel() < n:
        bufs.append(torch.zeros(max(n, 1 << 15), dtype=torch.int32, device=device))
    return bufs[-1]

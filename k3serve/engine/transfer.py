"""Small host -> device copies that do not wait for the GPU.

``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronises the stream,
so the host stalls until the GPU has finished everything queued (with overlapped scheduling: the
whole previous step). From pinned memory the copy is queued like a kernel and the host moves on;
PyTorch's pinned-memory cache keeps the source alive until the copy has run.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without a host sync on CUDA."""
    t = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def fill_pending_tokens(input_ids: torch.Tensor, fixup: tuple | None) -> None:
    """Overlapped scheduling: ``fixup`` = (flat positions, rows, tokens on the device) names the
    inputs of a step that the previous step sampled and the host has not read yet; they are copied
    in on the device (after the inputs' own host copy, before the forward). Where both lists are
    runs (a decode step whose rows keep the previous step's order) one slice copy does it."""
    if fixup is None:
        return
    dst, src, tokens = fixup
    if SLICE_FIXUP and dst and _is_run(dst) and _is_run(src):
        input_ids[dst[0]:dst[0] + len(dst)].copy_(tokens[src[0]:src[0] + len(src)], non_blocking=True)
    else:
        input_ids[to_device(dst, input_ids.device)] = tokens[to_device(src, tokens.device)]


# Runs of positions copied as one slice: two index uploads and a gather + scatter fewer before each
# overlapped decode step (kimi-linear batch 1 on the H200: RESULTS.md twenty-fourth session).
# False: always by index lists (A/B timing).
SLICE_FIXUP = True


def _is_run(values: list[int]) -> bool:
    return all(v == values[0] + i for i, v in enumerate(values))

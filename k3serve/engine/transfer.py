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
    in on the device (after the inputs' own host copy, before the forward)."""
    if fixup is not None:
        dst, src, tokens = fixup
        input_ids[to_device(dst, input_ids.device)] = tokens[to_device(src, tokens.device)]

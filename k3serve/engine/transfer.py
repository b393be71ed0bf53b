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

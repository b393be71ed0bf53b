"""ops/tickets.py's counters buffer: one a device, made outside CUDA graph captures (a buffer first
made in a capture is zeroed only when that graph replays; its pool memory may hold stale data)."""

import pytest
import torch

pytest.importorskip("triton")

from k3serve.ops import tickets as tk  # noqa: E402


def test_tickets_one_zeroed_buffer_a_device_never_made_in_a_capture(monkeypatch):
    monkeypatch.setattr(tk, "_BUFFERS", {})
    dev = torch.device("cpu")
    first = tk.tickets(dev, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert tk.tickets(dev, first.numel()) is first
    monkeypatch.setattr(tk, "_capturing", lambda device: True)
    assert tk.tickets(dev, 7) is first  # in a capture: the buffer made before it
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        tk.tickets(dev, first.numel() + 1)
    monkeypatch.setattr(tk, "_capturing", lambda device: False)
    bigger = tk.tickets(dev, first.numel() + 1)
    assert bigger is not first and bigger.numel() > first.numel() and not bigger.any()
    assert tk.tickets(dev, 3) is bigger  # the newest serves every smaller need; the old stays alive
    assert [id(b) for b in tk._BUFFERS[dev, torch.int32]] == [id(first), id(bigger)]
    wide = tk.tickets(dev, 3, torch.int64)  # the growing barrier's counts: a buffer of their own
    assert wide.dtype == torch.int64 and not wide.any() and tk.tickets(dev, 3) is bigger

"""The one error measure every GPU check and benchmark in bench/ reports against its reference."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against the reference ``b``, in float64 (on b's device)."""
    a, b = a.double(), b.double()
    return ((a.to(b.device) - b).norm() / b.norm()).item()

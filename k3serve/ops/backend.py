"""Which implementation an op runs on a tensor's device: the plain-torch reference or Triton.

``K3SERVE_<OP>_BACKEND`` picks per op (OP: MOE, MLA, KDA, NORM, ATTNRES): ``triton`` or ``torch``
(KDA also ``fla``: fla-core's kernels without our fused decode), ``auto`` or unset for the default.
CPU tensors always take the reference, the path CI tests. On CUDA the default is
``TRITON_BY_DEFAULT``: off until bench/gpu_check_model.py passes on the H200 with every Triton
kernel on (whole model, bf16 vs the fp32 reference; each kernel's own check already passes), so
that flipping one constant is the whole switch. A misspelt value is an error, not a silent
fallback to the slow path.
"""

from __future__ import annotations

import os

import torch

TRITON_BY_DEFAULT = False
_CHOICES = {"MOE": ("triton", "torch"), "MLA": ("triton", "torch"), "NORM": ("triton", "torch"),
            "ATTNRES": ("triton", "torch"), "KDA": ("triton", "torch", "fla")}


def triton_enabled(op: str, device: torch.device | str) -> bool:
    """Whether ``op`` runs its Triton kernel for tensors on ``device``."""
    if op not in _CHOICES:
        raise ValueError(f"unknown op {op!r}; one of {sorted(_CHOICES)}")
    var = f"K3SERVE_{op}_BACKEND"
    choice = os.environ.get(var, "auto") or "auto"
    if choice != "auto" and choice not in _CHOICES[op]:
        raise ValueError(f"{var}={choice!r}: expected one of {', '.join(('auto',) + _CHOICES[op])}")
    if torch.device(device).type != "cuda":
        return False
    return TRITON_BY_DEFAULT if choice == "auto" else choice == "triton"

"""Which implementation an op runs on a tensor's device: the plain-torch reference or Triton.

``K3SERVE_<OP>_BACKEND`` picks per op (OP: MOE, MLA, KDA, NORM, ATTNRES, GLU, GEMV: dense linears
of a few tokens, SAMPLE: the sampler's top-k / top-p / min-p draw): ``triton`` or
``torch`` (KDA also ``fla``: fla-core's kernels without our fused decode), ``auto`` or unset for
the default, which ``K3SERVE_BACKEND=triton|torch`` sets for every op at once. CPU tensors always
take the reference, the path CI tests. On CUDA the default is otherwise ``TRITON_BY_DEFAULT``: on
since bench/gpu_check_model.py passed on the H200 with every Triton kernel on (whole model, bf16
vs the fp32 reference: the same errors as the fla + torch bf16 run, RESULTS.md seventh session;
each kernel has its own check too). ``K3SERVE_BACKEND=torch`` is the way back to the plain-torch
path (with fla-core for KDA). A misspelt value is an error, not a silent fallback to the slow
path. The variables are read once (``reload``; every engine start re-reads them).
"""

from __future__ import annotations

import os

import torch

TRITON_BY_DEFAULT = True
_CHOICES = {"MOE": ("triton", "torch"), "MLA": ("triton", "torch"), "NORM": ("triton", "torch"),
            "ATTNRES": ("triton", "torch"), "GLU": ("triton", "torch"), "KDA": ("triton", "torch", "fla"),
            "GEMV": ("triton", "torch"), "SAMPLE": ("triton", "torch")}

OPS = tuple(_CHOICES)
_resolved: dict[str, str] | None = None  # op -> auto | triton | torch | fla, read by reload()


def reload() -> dict[str, str]:
    """Reads and checks the environment; ``triton_enabled`` answers from this snapshot (it sits
    on every layer's path: ~100 lookups an eager step). Engines call it when they start; call it
    after changing the variables in a running process."""
    global _resolved
    every = os.environ.get("K3SERVE_BACKEND", "auto") or "auto"
    if every not in ("auto", "triton", "torch"):
        raise ValueError(f"K3SERVE_BACKEND={every!r}: expected one of auto, triton, torch")
    resolved = {}
    for op, choices in _CHOICES.items():
        var = f"K3SERVE_{op}_BACKEND"
        choice = os.environ.get(var, "auto") or "auto"
        if choice != "auto" and choice not in choices:
            raise ValueError(f"{var}={choice!r}: expected one of {', '.join(('auto',) + choices)}")
        resolved[op] = every if choice == "auto" else choice
    _resolved = resolved
    return resolved


def override(op: str, value: str | None) -> None:
    """Sets (None: unsets) ``K3SERVE_<op>_BACKEND`` in this process and re-reads the snapshot."""
    var = f"K3SERVE_{op}_BACKEND"
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value
    reload()


def choice(op: str) -> str:
    """The configured choice for ``op``: auto (the default), triton, torch, or fla (KDA)."""
    c = (_resolved or reload()).get(op)
    if c is None:
        raise ValueError(f"unknown op {op!r}; one of {sorted(_CHOICES)}")
    return c


def triton_enabled(op: str, device: torch.device | str) -> bool:
    """Whether ``op`` runs its Triton kernel for tensors on ``device`` (CPU: never)."""
    c = choice(op)
    if (device.type if isinstance(device, torch.device) else torch.device(device).type) != "cuda":
        return False
    return TRITON_BY_DEFAULT if c == "auto" else c == "triton"


def check_environment() -> None:
    """Re-reads the environment and checks every ``K3SERVE_BACKEND`` / ``K3SERVE_<OP>_BACKEND``
    value: run at startup, so a typo stops the server before weights
    load, not at its first request."""
    reload()

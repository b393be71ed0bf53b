"""Programmatic dependent launch (Hopper and later): a decode step is a few hundred short kernels
back to back, and each one's launch and ramp-up used to start only once the previous one's last
block had drained. A kernel launched with PDL may be scheduled while its predecessor finishes;
its first act is ``griddepcontrol.wait`` (``pdl_start``), which returns once the predecessor has
completed and its memory is visible, so only the launch latency overlaps: every read and write
still follows the previous kernel's. (Hinting a kernel's weights into L2 before its wait, so their
streaming would overlap the predecessor's tail, was measured and lost: whole slabs thrash L2, the
first tiles alone gain nothing; RESULTS.md tenth session.) It then lets its own successor launch early. Kernels that
take no part (cuBLAS, torch) are ordered as before. ``K3SERVE_PDL=0`` turns it off (A/B timing).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .autotune import interpreted


@triton.jit
def pdl_start(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_ON = {"USE_PDL": True, "launch_pdl": True}
_OFF: dict = {}


def launch(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch on ``device``: the kernel's ``USE_PDL`` constexpr and
    Triton's ``launch_pdl`` option, or nothing where PDL is off (CPU, interpreter, pre-Hopper).
    On every Triton launch of a step, so answered from a cache (the variable is read once)."""
    if device.type != "cuda":
        return _OFF
    return _ON if _enabled(device.index if device.index is not None else torch.cuda.current_device()) else _OFF


@functools.lru_cache(maxsize=None)
def _enabled(index: int) -> bool:
    if interpreted() or os.environ.get("K3SERVE_PDL", "1") == "0" or not _TRITON_HAS_PDL:
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


# launch_pdl and tl.extra.cuda.gdc_* arrived in Triton 3.4 (the device's torch 2.11 ships 3.6).
_TRITON_HAS_PDL = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 4)

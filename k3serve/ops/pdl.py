"""Programmatic dependent launch (Hopper and later): a decode step is a few hundred short kernels
back to back, and each one's launch and ramp-up used to start only once the previous one's last
block had drained. A kernel launched with PDL may be scheduled while its predecessor finishes;
its first act is ``griddepcontrol.wait`` (``pdl_start``), which returns once the predecessor has
completed and its memory is visible, so by default only the launch latency overlaps: every read
and write still follows the previous kernel's. It then lets its own successor launch early.
Kernels that take no part (cuBLAS, torch) are ordered as before. ``K3SERVE_PDL=0`` turns it off
(A/B timing).

Work before the wait. A kernel starts while its predecessor runs, once every earlier kernel has
completed (each waited on its own predecessor before letting the next launch). Before its wait it
may therefore *read* what no kernel of the step writes, or what an earlier step or a kernel two
or more launches back wrote: model weights, constant tables (``expert_sort.one_row_blocks``), the
step's inputs; it must *write* nothing (its output may be memory the caching allocator took back
from a tensor the predecessor still reads). Where the predecessor is short and latency-bound this
pays: the router logits' weight tile (2.2 -> 1.1 us a call; with the add + norm before it, one
launch: ``moe_triton.add_norm_router_logits``), the small-K GEMVs' one weight tile a program
(``gemv_triton``, ``static_weight``), a one-token step's joined shared expert computed during the
routing (``moe_triton`` STATIC_TAIL, and ``moe_gluon``'s), the MXFP4 down GEMM's first weight step
(``moe_gluon`` PREFETCH). Where it was tried against a bandwidth-bound or
register-hungry kernel it lost: weights hinted into L2 over whole slabs (L2 thrash), the mixers'
o_proj rows hinted during the fused KDA step (that step +2.9 us a layer), a GEMV's first tile of
several (a pipeline stage of shared memory), the fused KDA step's first state tile (registers held
across the convs) (RESULTS.md tenth, twenty-third to twenty-fifth sessions).
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

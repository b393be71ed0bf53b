"""Small host <-> device copies that do not wait for the GPU, nor hold up its stream.

``torch.tensor(values, device="cuda")`` copies from pageable memory and synchronises the stream,
so the host stalls until the GPU has finished everything queued (with overlapped scheduling: the
whole previous step). From pinned memory the copy is queued like a kernel and the host moves on;
PyTorch's pinned-memory cache keeps the source alive until the copy has run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.autotune import interpreted


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


# A step's host <-> device copies on side streams (``readback_stream``, ``StaticInputs``); False: on
# the step's own stream, the upload straight into the graphs' inputs (A/B timing).
SIDE_STREAMS = True
_READBACK: dict[torch.device, torch.cuda.Stream] = {}


def readback_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that copies a device's sampled tokens back to the host (one a device; the current
    stream where SIDE_STREAMS is off)."""
    if not SIDE_STREAMS:
        return torch.cuda.current_stream(device)
    if device not in _READBACK:
        _READBACK[device] = torch.cuda.Stream(device)
    return _READBACK[device]


# The hidden field of ``decode_graphs.StaticInputs`` beside its input tokens: per token, the row of
# the previous step's device tokens that replaces it, or -1.
PENDING_ROWS = "pending_rows"


@triton.jit
def _copy_staged_kernel(DST, SRC, TOKENS, n, P, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    value = tl.load(SRC + i, mask=i < n)
    row = tl.load(SRC + P + i, mask=i < P, other=-1)
    token = tl.load(TOKENS + row, mask=row >= 0, other=0)
    tl.store(DST + i, tl.where(row >= 0, token.to(value.dtype), value), mask=i < n)


def copy_staged(dst: torch.Tensor, src: torch.Tensor, n: int, p: int, tokens: torch.Tensor) -> None:
    """dst[:n] = src[:n], where the first p entries (input tokens) are laid out first and the next p
    name, by a row >= 0 of ``tokens``, the token that replaces each (``fill_pending_tokens`` from
    the staged copy). One Triton kernel on CUDA (or under Triton's interpreter), torch elsewhere."""
    if dst.is_cuda or interpreted():
        _copy_staged_kernel[(triton.cdiv(n, 1024),)](dst, src, tokens, n, p, BLOCK=1024)
        return
    dst[:n] = src[:n]
    rows = src[p:2 * p]
    take = rows >= 0
    dst[:p][take] = tokens[rows[take]].to(dst.dtype)

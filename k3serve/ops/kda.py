"""KDA core over a varlen batch: decode steps batched, prefill chunks chunked.

One entry point, two implementations: the plain-torch reference (CPU, tests) and fla-core's
Triton kernels on CUDA when fla is installed (``k3serve[gpu]``). States live in the engine's
slot pool [num_slots, H, K, V] fp32 and are read at, and written back to, each sequence's slot.
"""

from __future__ import annotations

import itertools

import torch

from ..model.batch import ForwardBatch
from . import fla_backend
from .backend import choice
from .kda_ref import kda_chunked_ref, kda_gate, kda_recurrent_ref, l2norm

# Chunk length of the reference prefill. 64 matches fla; CPU training (tools/train_tiny.py) runs
# faster with 32 because the pairwise-decay tensor is [H, C, C, K].
REF_CHUNK_SIZE = 64


def kda_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             scale: float, state: torch.Tensor, batch: ForwardBatch, backend: str | None = None,
             gate: tuple | None = None, qk_normalized: bool = False) -> torch.Tensor:
    """q, k (post conv, L2-normalised here unless ``qk_normalized``: the conv did it), g (log
    decay), all [T, H, K]; v [T, H, V]; beta [T, H].
    ``gate`` = (A_log, dt_bias, lower_bound): g is the gate's pre-activation f instead and the
    decay ``kda_gate(f, ...)`` is computed here (inside fla's chunk kernel for prefill: no fp32
    [T, H, K] decay tensor in memory). ``state`` [num_slots, H, K, V] is updated in place at
    ``batch.kda_slots``. Returns o [T, H, V] (fp32 from the reference, v's dtype from fla)."""
    backend = backend or choice("KDA")  # auto | torch | fla | triton
    if backend in ("auto", "triton"):  # "triton" fuses decode-only steps in the mixer; the rest is auto
        backend = "fla" if q.is_cuda and fla_backend.available() else "torch"
    if backend == "fla":
        return fla_backend.kda_core(q, k, v, g, beta, scale, state, batch, gate, qk_normalized)
    with torch.autocast(q.device.type, enabled=False):  # the reference is fp32, also inside a bf16 trainer
        return _kda_core_ref(q, k, v, kda_gate(g, *gate) if gate is not None else g, beta, scale, state, batch,
                             qk_normalized)


def _kda_core_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  scale: float, state: torch.Tensor, batch: ForwardBatch, qk_normalized: bool = False) -> torch.Tensor:
    q, k = (q.float(), k.float()) if qk_normalized else (l2norm(q), l2norm(k))
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    nd = batch.num_decodes
    has_ctx = batch.context_lens > 0
    if nd:
        slots = batch.kda_slots[:nd]
        s0 = torch.where(has_ctx[:nd].view(-1, 1, 1, 1), state[slots], 0.0)
        o, s1 = kda_recurrent_ref(q[:nd, None], k[:nd, None], v[:nd, None], g[:nd, None], beta[:nd, None], scale, s0)
        out[:nd] = o[:, 0]
        state[slots] = s1
    # Prefill chunks of equal length run as one call with the sequences folded into the head
    # dimension (heads are independent): one chunk loop for a whole training batch, not one each.
    starts = [0, *itertools.accumulate(batch.query_lens_host)]
    groups: dict[int, list[int]] = {}
    for i in range(nd, batch.num_seqs):
        groups.setdefault(batch.query_lens_host[i], []).append(i)
    H, K = q.shape[1:]
    V = v.shape[-1]
    for qlen, seqs in groups.items():
        B = len(seqs)
        tok = (torch.tensor([starts[i] for i in seqs], device=q.device)[:, None]
               + torch.arange(qlen, device=q.device)).t()  # [L, B] flat token index
        fold = lambda x: x[tok].reshape(qlen, B * H, *x.shape[2:])  # noqa: E731  [L, B*H, ...]
        slots = batch.kda_slots[seqs]
        s0 = None
        if any(batch.context_lens_host[i] > 0 for i in seqs):
            s0 = torch.where(has_ctx[seqs].view(-1, 1, 1, 1), state[slots], 0.0).reshape(B * H, K, V)
        o, s1 = kda_chunked_ref(fold(q), fold(k), fold(v), fold(g), fold(beta), scale, s0, chunk_size=REF_CHUNK_SIZE)
        out[tok] = o.view(qlen, B, H, V)
        state[slots] = s1.view(B, H, K, V)
    return out

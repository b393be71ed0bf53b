"""Shape-static decode steps, captured as CUDA graphs per batch-size bucket.

A decode-only step of n sequences runs at the smallest bucket b >= n. Its inputs are copied into
static buffers; rows n..b are padding that point at the pool's scratch slot and page with no
context, so they can never touch a live sequence. On CUDA the graph captured for bucket b replays
the whole forward + lm_head: no Python per layer, no host sync, no allocation. Without CUDA (or
before capture) the same padded step runs eagerly, which is how the CPU tests check the padding.

Capture needs every decode op to be shape-static and sync-free: the Triton MoE
(the Triton MoE backend, ops/backend.py; the reference loops over expert counts on the host) and the
Triton MLA decode (the reference attends over the table's full width in static mode, correct but
slow for long contexts). ``capture_blockers`` names what is missing; the engine then stays eager.
"""

from __future__ import annotations

import logging
from itertools import chain

import numpy as np
import torch

from ..cache.pool import UnifiedPool
from ..model.batch import ForwardBatch, SeqChunk
from ..model.k3 import K3ForCausalLM
from ..ops.backend import triton_enabled
from .transfer import fill_pending_tokens

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (vLLM's capture sizes), ``max_batch`` last."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16))
    return sizes + [max_batch]


def capture_blockers(device: torch.device) -> list[str]:
    """Why decode steps of this process cannot be captured (empty: they can)."""
    if device.type != "cuda":
        return ["not a CUDA device"]
    why = []
    if not triton_enabled("MOE", device):
        why.append("the torch MoE reference syncs on expert counts (set K3SERVE_BACKEND=triton or "
                   "K3SERVE_MOE_BACKEND=triton)")
    if not triton_enabled("MLA", device):
        why.append("the torch MLA decode attends over the full table width (set K3SERVE_BACKEND=triton or "
                   "K3SERVE_MLA_BACKEND=triton)")
    return why


class DecodeGraphs:
    def __init__(self, model: K3ForCausalLM, pool: UnifiedPool, max_batch: int, max_pages: int,
                 capture: bool = True, buckets: list[int] | None = None):
        self.model, self.pool = model, pool
        self.page_size = pool.layout.page_size
        self.buckets = sorted(buckets) if buckets else bucket_sizes(max_batch)
        self.max_pages = max_pages
        dev = pool.buffer.device
        B = self.buckets[-1]
        i64 = dict(dtype=torch.int64, device=dev)
        # All per-step inputs live in one device buffer filled by one copy from one (pinned) host
        # buffer: input ids, context lens, seq lens, KDA slots, slot mapping, then the block table.
        self._fields = ("input_ids", "context_lens", "seq_lens", "kda_slots", "slot_mapping")
        self._device_buf = torch.empty(B * (len(self._fields) + max_pages), **i64)
        self._host_buf = torch.empty(self._device_buf.shape, dtype=torch.int64, pin_memory=dev.type == "cuda")
        for i, name in enumerate(self._fields):
            setattr(self, name, self._device_buf[i * B:(i + 1) * B])
        self.block_table = self._device_buf[len(self._fields) * B:].view(B, max_pages)
        host = self._host_buf.numpy()  # numpy views of the (pinned) host buffer, filled each step
        self._host_np = [host[i * B:(i + 1) * B] for i in range(len(self._fields))]
        self._host_table_np = host[len(self._fields) * B:].reshape(B, max_pages)
        self.input_ids.zero_()
        self.context_lens.zero_()
        self.seq_lens.fill_(1)
        self.kda_slots.fill_(pool.scratch_slot)
        self.slot_mapping.fill_(pool.scratch_page * self.page_size)
        self.block_table.fill_(-1)
        self.block_table[:, 0] = pool.scratch_page
        self.query_start = torch.arange(B + 1, **i64)
        self.logits_indices = torch.arange(B, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._copied = None  # CUDA event: the last host -> device copy of the input buffer is done
        if capture:
            self._capture_all()

    # ---- per step -------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return (self.bucket_for(len(chunks)) is not None and all(len(c.token_ids) == 1 for c in chunks)
                and max(len(c.pages) for c in chunks) <= self.max_pages)

    def _fill_host(self, chunks: list[SeqChunk], b: int) -> list[int]:
        """Write a decode step's inputs (padded to bucket b) into the host buffer with numpy: one
        token per sequence, so no ForwardBatch is built (its ~20 small torch ops cost ~0.2 ms at
        batch 1 and ~1 ms at 256 on the host). Returns the context lengths."""
        n, ps = len(chunks), self.page_size
        ids, ctx, seq, slots, mapping = self._host_np
        table = self._host_table_np
        ctx_list = [c.context_len for c in chunks]
        npages = np.fromiter((len(c.pages) for c in chunks), np.int64, n)
        ids[:n] = [c.token_ids[0] for c in chunks]
        ctx[:n] = ctx_list
        if (npages * ps <= ctx[:n]).any():
            i = int(np.argmax(npages * ps <= ctx[:n]))
            raise ValueError(f"sequence with {ctx_list[i]}+1 tokens needs {ctx_list[i] // ps + 1} pages, "
                             f"got {npages[i]}")
        seq[:n] = ctx[:n] + 1
        slots[:n] = [c.kda_slot for c in chunks]
        table[:b] = -1
        rows = np.repeat(np.arange(n), npages)
        pages = np.fromiter(chain.from_iterable(c.pages for c in chunks), np.int64, rows.size)
        # A replayed graph dereferences these ids with no bounds check: refuse a bad one here,
        # on the host, rather than read or write another sequence's (or no) memory.
        lay = self.pool.layout
        if lay.page_bytes and rows.size and not (0 <= pages.min() and pages.max() < self.pool.page_capacity):
            raise ValueError(f"page id out of range [0, {self.pool.page_capacity}): {pages.min()}..{pages.max()}")
        if lay.slot_bytes and not (0 <= slots[:n].min() and slots[:n].max() < self.pool.slot_capacity):
            raise ValueError(f"KDA slot out of range [0, {self.pool.slot_capacity}): {slots[:n].min()}..{slots[:n].max()}")
        table[rows, np.arange(rows.size) - np.repeat(np.cumsum(npages) - npages, npages)] = pages
        mapping[:n] = table[np.arange(n), ctx[:n] // ps] * ps + ctx[:n] % ps
        # padding rows: no context, scratch slot and page (nothing live is touched)
        ids[n:b], ctx[n:b], seq[n:b], slots[n:b] = 0, 0, 1, self.pool.scratch_slot
        mapping[n:b] = self.pool.scratch_page * ps
        table[n:b, 0] = self.pool.scratch_page
        return ctx_list + [0] * (b - n)

    def run(self, chunks: list[SeqChunk], fixup: tuple | None = None) -> torch.Tensor:
        """fp32 logits [n, V] of a decode-only step (``fits(chunks)`` must hold). ``fixup`` =
        (rows, source rows, tokens on the device): input ids still on the device (overlap)."""
        n = len(chunks)
        b = self.bucket_for(n)
        if self._copied is not None:  # the host buffer is rewritten below: its last copy must be done
            self._copied.synchronize()
        context_lens = self._fill_host(chunks, b)
        # One copy; rows past b are stale and never read by bucket b.
        self._device_buf.copy_(self._host_buf, non_blocking=True)
        if self._device_buf.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()
        fill_pending_tokens(self.input_ids, fixup)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(self._static_batch(b, context_lens))[:n]

    # ---- capture --------------------------------------------------------------------------
    def _static_batch(self, b: int, context_lens_host: list[int]) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], query_start=self.query_start[:b + 1], context_lens=self.context_lens[:b],
            seq_lens=self.seq_lens[:b], kda_slots=self.kda_slots[:b], block_table=self.block_table[:b],
            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b], num_decodes=b,
            page_size=self.page_size, query_lens_host=[1] * b, context_lens_host=context_lens_host,
            static_shapes=True)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(self.model(batch, self.pool.handles))

    def _capture_all(self) -> None:
        """Largest bucket first so the smaller graphs reuse its memory pool. Buffers hold padding
        (scratch slot and page) while capturing, so warm-up runs touch no live state."""
        mempool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: Triton compiles / autotunes outside the capture
                for _ in range(2):
                    self._forward(self._static_batch(b, [1] * b))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # A batch object of its own: one used in the warm-up would carry per-step tensors it
            # cached there (ForwardBatch.has_context), and the graph would replay those stale values
            # instead of recomputing them from the static buffers.
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[b] = self._forward(self._static_batch(b, [1] * b))  # no "fresh" rows baked in
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

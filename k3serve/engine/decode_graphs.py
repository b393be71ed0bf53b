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
import time
from itertools import chain

import numpy as np
import torch

from ..cache.pool import UnifiedPool
from ..model.batch import ForwardBatch, SeqChunk
from ..model.k3 import K3ForCausalLM
from ..ops.backend import triton_enabled
from . import transfer
from .transfer import PENDING_ROWS, copy_staged, fill_pending_tokens

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


class StaticInputs:
    """A static step's int64 inputs as named fields of one device buffer, written each step through
    numpy views of a (pinned) host buffer and sent by one copy: a step's inputs cost one transfer,
    not one per field. Every buffer starts at -1 (a block table's "no page").

    ``pending`` names the field of input tokens: a hidden field beside it holds, per token, the row
    of the previous step's sampled tokens (still on the device, overlapped scheduling) that replaces
    it, or -1; ``upload(..., fixup)`` fills it.

    On CUDA no copy-engine operation sits in the step's stream (each costs ~10 us of GPU time at a
    step boundary, bench/graph_start_probe.py): the host fills one of two pinned buffers, a side
    stream copies it into one of two device staging buffers while the GPU still runs the previous
    step, and the step's stream, once it has arrived, moves it into the device buffer the graphs
    read by one kernel (``transfer.copy_staged``) that also writes the pending tokens. ``host()``
    waits only until the upload of two steps ago has left the host buffer it returns."""

    def __init__(self, device: torch.device, sizes: dict[str, int], pending: str | None = "input_ids"):
        if pending is not None:
            if next(iter(sizes)) != pending:
                raise ValueError(f"the pending field {pending!r} must come first, got {list(sizes)}")
            sizes = {pending: sizes[pending], PENDING_ROWS: sizes[pending],
                     **{k: v for k, v in sizes.items() if k != pending}}
        self.pending = pending
        total = sum(sizes.values())
        self.device_buf = torch.full((total,), -1, dtype=torch.int64, device=device)
        cuda = device.type == "cuda"
        self._hosts = [torch.full((total,), -1, dtype=torch.int64, pin_memory=cuda) for _ in range(1 + cuda)]
        self._views, self.dev, at = [{} for _ in self._hosts], {}, 0
        for name, n in sizes.items():
            self.dev[name] = self.device_buf[at:at + n]
            for views, buf in zip(self._views, self._hosts):
                views[name] = buf.numpy()[at:at + n]
            at += n
        self._last = n  # the last field's size
        self._step = 0
        if cuda:
            self._stages = [torch.full((total,), -1, dtype=torch.int64, device=device) for _ in range(2)]
            self._stream = torch.cuda.Stream(device)
            self._arrived = [torch.cuda.Event() for _ in range(2)]  # the upload from host / into stage i
            self._moved = [torch.cuda.Event() for _ in range(2)]  # the kernel that read stage i
            # (the staging buffers' fill above is queued on the current stream, maybe behind a busy
            # step: the side stream's first copy must not overtake it)
            self._stream.wait_stream(torch.cuda.current_stream(device))

    def host(self) -> dict[str, np.ndarray]:
        """The host views to fill for the next ``upload`` (call first: it waits for the buffer)."""
        i = self._step % len(self._hosts)
        if len(self._hosts) > 1:
            self._arrived[i].synchronize()  # (never recorded: returns at once)
        return self._views[i]

    def upload(self, last_used: int | None = None, fixup: tuple | None = None) -> None:
        """Send the fields, the last one only up to ``last_used`` elements (None: whole); ``fixup``
        = (positions in the pending field, rows of the device tokens, those tokens)."""
        n = self.device_buf.numel() - self._last + (self._last if last_used is None else last_used)
        i = self._step % len(self._hosts)
        self._step += 1
        tokens, p = self.device_buf, 0
        if self.pending is not None:
            rows = self._views[i][PENDING_ROWS]
            rows.fill(-1)
            p = rows.size
            if fixup is not None and fixup[0]:
                dst, src, tokens = fixup
                rows[dst] = src
        elif fixup is not None:
            raise ValueError("a fixup needs a pending field")
        if not self.device_buf.is_cuda:
            copy_staged(self.device_buf, self._hosts[i], n, p, tokens)
            return
        if not transfer.SIDE_STREAMS:  # (A/B timing: the copies in the step's stream)
            self.device_buf[:n].copy_(self._hosts[i][:n], non_blocking=True)
            self._arrived[i].record()
            if self.pending is not None:
                fill_pending_tokens(self.dev[self.pending], fixup)
            return
        stage, stream = self._stages[i], self._stream
        stream.wait_event(self._moved[i])
        with torch.cuda.stream(stream):
            stage[:n].copy_(self._hosts[i][:n], non_blocking=True)
            self._arrived[i].record(stream)
        torch.cuda.current_stream(self.device_buf.device).wait_event(self._arrived[i])
        copy_staged(self.device_buf, stage, n, p, tokens)
        self._moved[i].record()


def page_major(flat, rows: int, max_pages: int):
    """A static step's block table [rows, max_pages] over the flat buffer ``flat`` (numpy or torch),
    the page index outer: the first w pages of every row are the buffer's first w * rows entries,
    so one copy of that prefix sends a step's pages however wide max_model_len makes the table
    (row-major, a 1M-token max_model_len sent 128 KB a row every step: 32 MB at 256 rows). The
    decode kernels read it through its strides."""
    if isinstance(flat, np.ndarray):
        return flat[:rows * max_pages].reshape(max_pages, rows).T
    return flat[:rows * max_pages].view(max_pages, rows).t()


def check_ids(pool: UnifiedPool, pages: np.ndarray, slots: np.ndarray) -> None:
    """A replayed graph dereferences page and slot ids with no bounds check: refuse a bad one here,
    on the host, rather than read or write another sequence's (or no) memory."""
    lay = pool.layout
    if lay.page_bytes and pages.size and not (0 <= pages.min() and pages.max() < pool.page_capacity):
        raise ValueError(f"page id out of range [0, {pool.page_capacity}): {pages.min()}..{pages.max()}")
    if lay.slot_bytes and slots.size and not (0 <= slots.min() and slots.max() < pool.slot_capacity):
        raise ValueError(f"KDA slot out of range [0, {pool.slot_capacity}): {slots.min()}..{slots.max()}")


def capture_graphs(forwards: dict, what: str, prepare=None) -> tuple[dict, dict]:
    """Captures ``forwards`` (key -> a no-argument step returning its output), in the given order
    into one memory pool (largest step first, so the smaller ones reuse its memory). Each step
    runs twice on a side stream first (Triton compiles and autotunes outside the capture), after
    ``prepare(key)`` where given (filling the static buffers: host copies cannot be captured).
    Returns (graphs, outputs) by key."""
    mempool = torch.cuda.graph_pool_handle()
    graphs, outputs, t0 = {}, {}, time.perf_counter()
    for key, forward in forwards.items():
        if prepare is not None:
            prepare(key)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool):
            outputs[key] = forward()
        graphs[key] = graph
    torch.cuda.synchronize()
    log.info("captured %d %s graphs in %.1f s: %s", len(graphs), what, time.perf_counter() - t0, list(forwards))
    return graphs, outputs


def write_pages(pool: UnifiedPool, table: np.ndarray, row0: int, chunks: list[SeqChunk], npages: np.ndarray,
                slots: np.ndarray) -> None:
    """Rows row0.. of a static step's host block table: each chunk's first ``npages`` pages, the
    page and slot ids checked first (``check_ids``)."""
    rows = row0 + np.repeat(np.arange(len(chunks)), npages)
    pages = np.fromiter(chain.from_iterable(c.pages if p == len(c.pages) else c.pages[:p]
                                            for c, p in zip(chunks, npages)), np.int64, rows.size)
    check_ids(pool, pages, slots)
    table[rows, np.arange(rows.size) - np.repeat(np.cumsum(npages) - npages, npages)] = pages


def fill_decode_rows(pool: UnifiedPool, chunks: list[SeqChunk], b: int, ids, ctx, seq, slots, mapping,
                     table) -> tuple[list[int], int]:
    """Rows 0..b of a static step's host arrays (numpy) for decode ``chunks`` (one token each) and
    padding rows after them: no context, the scratch slot and page (nothing live is touched).
    Only the pages a row owns are written: past them its table row keeps older page ids (or -1),
    which no kernel reads (each stops at its sequence's length). Returns the context lengths
    (the padding's 0) and the widest row's pages (what of the table the step uses)."""
    n, ps = len(chunks), pool.layout.page_size
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
    write_pages(pool, table, 0, chunks, npages, slots[:n])
    mapping[:n] = table[np.arange(n), ctx[:n] // ps] * ps + ctx[:n] % ps
    ids[n:b], ctx[n:b], seq[n:b], slots[n:b] = 0, 0, 1, pool.scratch_slot
    mapping[n:b] = pool.scratch_page * ps
    table[n:b, 0] = pool.scratch_page
    return ctx_list + [0] * (b - n), int(npages.max(initial=1))


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
        self._fields = ("input_ids", "context_lens", "seq_lens", "kda_slots", "slot_mapping")
        self.inputs = StaticInputs(dev, {**{f: B for f in self._fields}, "block_table": B * max_pages})
        for name in self._fields:
            setattr(self, name, self.inputs.dev[name])
        self.input_ids.zero_()
        self.context_lens.zero_()
        self.seq_lens.fill_(1)
        self.kda_slots.fill_(pool.scratch_slot)
        self.slot_mapping.fill_(pool.scratch_page * self.page_size)
        self.inputs.dev["block_table"][:B] = pool.scratch_page  # page 0 of every row, in every bucket's layout
        self.query_start = torch.arange(B + 1, **i64)
        self.logits_indices = torch.arange(B, **i64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    # ---- per step -------------------------------------------------------------------------
    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return (self.bucket_for(len(chunks)) is not None and all(len(c.token_ids) == 1 for c in chunks)
                and max(len(c.pages) for c in chunks) <= self.max_pages)

    def _fill_host(self, chunks: list[SeqChunk], b: int) -> tuple[list[int], int]:
        """Write a decode step's inputs (padded to bucket b) into the host buffer with numpy: one
        token per sequence, so no ForwardBatch is built (its ~20 small torch ops cost ~0.2 ms at
        batch 1 and ~1 ms at 256 on the host). Returns the context lengths and the table's used width."""
        host = self.inputs.host()
        return fill_decode_rows(self.pool, chunks, b, *(host[f] for f in self._fields),
                                page_major(host["block_table"], b, self.max_pages))

    def run(self, chunks: list[SeqChunk], fixup: tuple | None = None) -> torch.Tensor:
        """fp32 logits [n, V] of a decode-only step (``fits(chunks)`` must hold). ``fixup`` =
        (rows, source rows, tokens on the device): input ids still on the device (overlap)."""
        n = len(chunks)
        b = self.bucket_for(n)
        context_lens, width = self._fill_host(chunks, b)
        self.inputs.upload(b * width, fixup)  # rows past b, pages past the widest row: never read by this step
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self._forward(self._static_batch(b, context_lens))[:n]

    # ---- capture --------------------------------------------------------------------------
    def _static_batch(self, b: int, context_lens_host: list[int]) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], query_start=self.query_start[:b + 1], context_lens=self.context_lens[:b],
            seq_lens=self.seq_lens[:b], kda_slots=self.kda_slots[:b],
            block_table=page_major(self.inputs.dev["block_table"], b, self.max_pages),
            slot_mapping=self.slot_mapping[:b], logits_indices=self.logits_indices[:b], num_decodes=b,
            page_size=self.page_size, query_lens_host=[1] * b, context_lens_host=context_lens_host,
            static_shapes=True)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            return self.model.compute_logits(self.model(batch, self.pool.handles))

    def _capture_all(self) -> None:
        """Buffers hold padding (scratch slot and page) while capturing, so warm-up runs touch no
        live state. Each step builds a batch object of its own: one used in the warm-up would carry
        per-step tensors it cached there (ForwardBatch.has_context), and the graph would replay
        those stale values instead of recomputing them from the static buffers."""
        self.graphs, self.outputs = capture_graphs(
            {b: (lambda b=b: self._forward(self._static_batch(b, [1] * b))) for b in reversed(self.buckets)},
            "decode")  # [1] * b: no "fresh" rows baked in

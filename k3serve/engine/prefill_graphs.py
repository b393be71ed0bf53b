"""Shape-static prefill steps of new prompts, captured as CUDA graphs per token bucket.

A short prompt's prefill step is host-bound: kimi-linear-48b's 512-token step launches ~800
kernels, 31 ms of GPU time in a 61-67 ms eager step (RESULTS.md seventeenth session). A step of
n new prompts (no cached context, each sampling its first token) of L tokens in all runs at the
smallest token bucket b > L: the tokens are copied into static buffers, and positions L..b form
one padding sequence on the pool's scratch slot, its latent rows all in the scratch page (its
outputs are never read, and it never touches a live sequence). The step's structure is static:
n + 1 sequences, b tokens; fla builds its chunk indices on the device (``use_graph``) and MLA's
one-launch prefill reads device-built sequence rows (``ForwardBatch.prefill_latents``). On CUDA
the graph captured for (n, b) replays the whole forward and the n last-token logits; without CUDA
(or before capture) the same padded step runs eagerly, which is how the CPU tests check it.

Only new prompts: a prompt on cached context (a prefix-cache hit, a later chunk) needs its
context's length on the host to size its attention, so it stays eager, as do mixed steps.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch

from ..cache.pool import UnifiedPool
from ..model.batch import ForwardBatch, SeqChunk
from ..model.k3 import K3ForCausalLM
from .decode_graphs import StaticInputs, capture_blockers, capture_graphs, check_ids
from .transfer import fill_pending_tokens


def prefill_blockers(device: torch.device) -> list[str]:
    """Why prefill steps of this process cannot be captured (empty: they can): the decode graphs'
    reasons, and every prefill op in its device-only form (fla's KDA, the Triton short conv, the
    one-launch MLA prefill)."""
    from ..model import mla
    from ..ops import fla_backend
    from ..ops.backend import choice, triton_enabled

    why = capture_blockers(device)
    if why[:1] == ["not a CUDA device"]:
        return why
    if choice("KDA") == "torch" or not fla_backend.available():
        why.append("KDA prefill needs fla-core (pip install fla-core) and a KDA backend other than torch")
    if not triton_enabled("KDA", device):
        why.append("the torch short conv reads host lengths (set K3SERVE_BACKEND=triton)")
    if not mla.VARLEN_PREFILL:
        why.append("the per-prompt MLA prefill reads host lengths (k3serve.model.mla.VARLEN_PREFILL)")
    return why


def token_buckets(max_tokens: int, smallest: int = 128) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_tokens`` (itself last): padding at most doubles
    a short step, whose cost is launches, not tokens."""
    sizes, b = [], smallest
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    return sizes + [max_tokens]


class PrefillGraphs:
    def __init__(self, model: K3ForCausalLM, pool: UnifiedPool, max_tokens: int = 2048, max_seqs: int = 1,
                 capture: bool = True, buckets: list[int] | None = None):
        if max_seqs < 1 or max_tokens < 2:
            raise ValueError(f"prefill graphs need max_seqs >= 1 and max_tokens >= 2, got {max_seqs}, {max_tokens}")
        self.model, self.pool = model, pool
        self.page_size = ps = pool.layout.page_size
        self.buckets = sorted(buckets) if buckets else token_buckets(max_tokens)
        self.max_seqs = max_seqs
        B, S = self.buckets[-1], max_seqs + 1  # S: the prompts and the padding sequence
        self.max_pages = -(-B // ps)
        self.inputs = StaticInputs(pool.buffer.device, dict(
            input_ids=B, slot_mapping=B, query_start=S + 1, seq_lens=S, kda_slots=S, logits_indices=max_seqs,
            block_table=S * self.max_pages))
        self.dev = self.inputs.dev
        self.context_lens = torch.zeros(S, dtype=torch.int64, device=pool.buffer.device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        if capture:
            self._capture_all()

    # ---- per step -------------------------------------------------------------------------
    def bucket_for(self, tokens: int) -> int | None:
        return next((b for b in self.buckets if b > tokens), None)  # > : the padding has a token

    def fits(self, chunks: list[SeqChunk]) -> bool:
        """New prompts of 2+ tokens (a one-token prompt is a decode row in the eager step, run by
        the decode kernels; the static step would take it through the prefill ones instead)."""
        return (1 <= len(chunks) <= self.max_seqs and all(c.context_len == 0 and len(c.token_ids) > 1 for c in chunks)
                and self.bucket_for(sum(len(c.token_ids) for c in chunks)) is not None)

    def _fill_host(self, chunks: list[SeqChunk], b: int) -> list[int]:
        """Write the step's inputs, padded to b tokens, into the host buffer; returns the
        sequences' token counts (the padding sequence's last)."""
        n, ps, pool = len(chunks), self.page_size, self.pool
        h = self.inputs.host()
        table = h["block_table"].reshape(-1, self.max_pages)
        lens = [len(c.token_ids) for c in chunks]
        L = sum(lens)
        npages = np.array([-(-q // ps) for q in lens], np.int64)
        if any(len(c.pages) < p for c, p in zip(chunks, npages)):
            i = next(i for i, c in enumerate(chunks) if len(c.pages) < npages[i])
            raise ValueError(f"sequence with {lens[i]} tokens needs {npages[i]} pages of {ps}, got {len(chunks[i].pages)}")
        rows = np.repeat(np.arange(n), npages)
        pages = np.fromiter(chain.from_iterable(c.pages[:p] for c, p in zip(chunks, npages)), np.int64, rows.size)
        slots = np.array([c.kda_slot for c in chunks], np.int64)
        check_ids(pool, pages, slots)
        h["input_ids"][:L] = list(chain.from_iterable(c.token_ids for c in chunks))
        h["input_ids"][L:b] = 0
        qs = h["query_start"]
        qs[0] = 0
        qs[1:n + 1] = np.cumsum(lens)
        qs[n + 1] = b
        h["seq_lens"][:n], h["seq_lens"][n] = lens, b - L
        h["kda_slots"][:n], h["kda_slots"][n] = slots, pool.scratch_slot
        h["logits_indices"][:n] = qs[1:n + 1] - 1
        table[:n + 1] = -1
        table[rows, np.arange(rows.size) - np.repeat(np.cumsum(npages) - npages, npages)] = pages
        table[n] = pool.scratch_page  # the padding sequence: every position in the scratch page
        seq = np.repeat(np.arange(n), lens)
        pos = np.arange(L) - np.repeat(qs[:n], lens)
        h["slot_mapping"][:L] = table[seq, pos // ps] * ps + pos % ps
        h["slot_mapping"][L:b] = pool.scratch_page * ps + np.arange(b - L) % ps
        return lens + [b - L]

    def run(self, chunks: list[SeqChunk], fixup: tuple | None = None) -> torch.Tensor:
        """fp32 logits [n, V] of each prompt's last token (``fits(chunks)`` must hold). ``fixup``:
        as ``DecodeGraphs.run`` (flat positions: the prompts' tokens lead, in order)."""
        n = len(chunks)
        b = self.bucket_for(sum(len(c.token_ids) for c in chunks))
        lens = self._fill_host(chunks, b)
        self.inputs.upload()
        fill_pending_tokens(self.dev["input_ids"], fixup)
        if (n, b) in self.graphs:
            self.graphs[n, b].replay()
            return self.outputs[n, b]
        return self._forward(self._static_batch(n, b, lens))

    # ---- capture --------------------------------------------------------------------------
    def _static_batch(self, n: int, b: int, lens: list[int]) -> ForwardBatch:
        d, S = self.dev, n + 1
        return ForwardBatch(
            input_ids=d["input_ids"][:b], query_start=d["query_start"][:S + 1], context_lens=self.context_lens[:S],
            seq_lens=d["seq_lens"][:S], kda_slots=d["kda_slots"][:S],
            block_table=d["block_table"].view(-1, self.max_pages)[:S], slot_mapping=d["slot_mapping"][:b],
            logits_indices=d["logits_indices"][:n], num_decodes=0, page_size=self.page_size,
            query_lens_host=lens, context_lens_host=[0] * S, static_shapes=True)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model(batch, self.pool.handles)
            return self.model.compute_logits(hidden[batch.logits_indices])

    def _capture_all(self) -> None:
        """Largest first. The buffers hold a padding-only step while capturing (every sequence on
        the scratch slot and page), so warm-up runs touch no live state."""
        keys = [(n, b) for b in reversed(self.buckets) for n in range(1, self.max_seqs + 1) if n < b]
        lens = {(n, b): [1] * n + [b - n] for n, b in keys}
        self.graphs, self.outputs = capture_graphs(
            {(n, b): (lambda n=n, b=b: self._forward(self._static_batch(n, b, lens[n, b]))) for n, b in keys},
            "prefill", prepare=lambda key: self._fill_scratch(*key))

    def _fill_scratch(self, n: int, b: int) -> None:
        """The device buffers of a step of n one-token prompts and the padding, all on the scratch
        slot and page (the ids lie past the pool's allocatable range, so not through check_ids)."""
        d, ps, dev = self.dev, self.page_size, self.dev["input_ids"].device
        d["input_ids"][:b].zero_()
        d["query_start"][:n + 2].copy_(torch.tensor([*range(n + 1), b], device=dev))
        d["seq_lens"][:n + 1].copy_(torch.tensor([1] * n + [b - n], device=dev))
        d["kda_slots"][:n + 1].fill_(self.pool.scratch_slot)
        d["logits_indices"][:n].copy_(torch.arange(n, device=dev))
        d["block_table"].view(-1, self.max_pages)[:n + 1].fill_(self.pool.scratch_page)
        d["slot_mapping"][:b].copy_(self.pool.scratch_page * ps + torch.arange(b, device=dev) % ps)

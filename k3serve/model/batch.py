"""What one forward step sees: a flat varlen batch and handles to engine-owned caches.

The runner (engine) owns all cache memory; the model only indexes it:
- KDA: one *slot* per sequence; per KDA layer a recurrent state [H, K, V] fp32 and a conv window
  [3P, W-1] in the model dtype.
- MLA: *pages* of ``page_size`` tokens; per MLA layer a latent [page_size, kv_lora_rank + rope]
  per page. A sequence's pages are listed in its row of ``block_table``.
Sequences are ordered decode steps first (query length 1), then prefill chunks, so the decode
part is one contiguous, batched slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import Sequence

import torch

from ..config import ModelConfig
from ..engine.transfer import to_device

KDA_CHUNK = 64  # the token chunk of fla's chunk_kda (its default chunk_size)


def _segments(counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(segment, index within it) of every element of back-to-back segments ``counts`` long (host
    tensors, no Python loop)."""
    segment = torch.repeat_interleave(torch.arange(len(counts)), counts)
    return segment, torch.arange(len(segment)) - (counts.cumsum(0) - counts)[segment]


@dataclass
class KDALayerCache:
    recurrent: torch.Tensor  # [num_slots, H, K, V] fp32 (may be a strided view into a pool)
    conv: torch.Tensor  # [num_slots, 3P, W-1]


@dataclass
class MLALayerCache:
    latent: torch.Tensor  # [num_pages, page_size, kv_lora_rank + qk_rope_head_dim]


@dataclass
class CacheHandles:
    kda: list[KDALayerCache]  # indexed by KDA-layer ordinal
    mla: list[MLALayerCache]  # indexed by MLA-layer ordinal
    page_size: int

    @classmethod
    def allocate(cls, config: ModelConfig, num_slots: int, num_pages: int, page_size: int = 64,
                 device=None, dtype: torch.dtype = torch.bfloat16) -> "CacheHandles":
        """Standalone caches (tests, tools). The engine builds views into its unified pool instead."""
        H, D, W = config.kda_num_heads, config.kda_head_dim, config.kda_conv_size
        kda = [
            KDALayerCache(
                recurrent=torch.zeros(num_slots, H, D, D, dtype=torch.float32, device=device),
                conv=torch.zeros(num_slots, 3 * H * D, W - 1, dtype=dtype, device=device),
            )
            for _ in range(config.num_kda_layers)
        ]
        mla = [
            MLALayerCache(torch.zeros(num_pages, page_size, config.mla_cache_width, dtype=dtype, device=device))
            for _ in range(config.num_mla_layers)
        ]
        return cls(kda=kda, mla=mla, page_size=page_size)


@dataclass
class SeqChunk:
    """One sequence's share of a step: new tokens on top of ``context_len`` cached ones."""

    token_ids: Sequence[int]
    context_len: int
    kda_slot: int
    pages: Sequence[int]  # MLA pages covering positions [0, context_len + len(token_ids))


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    query_start: torch.Tensor  # [N+1] int64, token offsets of each sequence in the flat batch
    context_lens: torch.Tensor  # [N] int64, tokens already cached before this step
    seq_lens: torch.Tensor  # [N] int64, context + new
    kda_slots: torch.Tensor  # [N] int64
    block_table: torch.Tensor  # [N, max_pages] int64 (padding -1)
    slot_mapping: torch.Tensor  # [T] int64, flat latent index page * page_size + offset
    logits_indices: torch.Tensor  # [N] int64, last new token of each sequence
    num_decodes: int  # leading sequences with exactly one new token
    page_size: int
    # Host copies of the per-sequence lengths (known to the scheduler; no device sync needed).
    query_lens_host: list[int]
    context_lens_host: list[int]
    # A shape-static step (engine/decode_graphs.py or prefill_graphs.py, possibly a captured CUDA
    # graph): ops must not size anything from the host lists, which then only describe the step
    # the batch was built for. Static steps are decode rows (on context), then prompts.
    static_shapes: bool = False
    # A static step's latent rows of its prefill sequences (cached + new, back to back): a bound on
    # their sum that sizes prefill_latents' device form (None: the step's prefill tokens).
    static_latent_rows: int | None = None

    def token_range(self, i: int) -> tuple[int, int]:
        """[start, end) of sequence i's new tokens in the flat batch (host ints)."""
        start = sum(self.query_lens_host[:i])
        return start, start + self.query_lens_host[i]

    @cached_property
    def has_context(self) -> torch.Tensor:
        """[N] int32, 1 where the sequence has cached tokens: computed once a step, read by every
        KDA layer's fused decode (in a captured graph, once per replay)."""
        return (self.context_lens > 0).to(torch.int32)

    @cached_property
    def latent_page_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset in page) of each new token's latent row: once a step, not per MLA layer."""
        return self.slot_mapping // self.page_size, self.slot_mapping % self.page_size

    @cached_property
    def token_seq(self) -> torch.Tensor:
        """[T] int64, the sequence of each new token (sizes from the host: no device sync)."""
        return torch.repeat_interleave(torch.arange(self.num_seqs, device=self.query_start.device),
                                       self.query_start.diff(), output_size=self.num_tokens)

    @cached_property
    def prefill_cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(device, host) [P+1] int64 token offsets of the non-decode sequences among their own
        tokens, once a step. A static prefill step (engine/prefill_graphs.py) has them on the
        device only: (offsets, None), from which fla builds its chunk indices on the device."""
        if self.static_shapes:
            return self.query_start[self.num_decodes:] - self.num_decodes, None
        cpu = torch.zeros(self.num_seqs - self.num_decodes + 1, dtype=torch.int64)
        cpu[1:] = torch.tensor(self.query_lens_host[self.num_decodes:], dtype=torch.int64).cumsum(0)
        return to_device(cpu, self.query_start.device), cpu

    @cached_property
    def kda_chunk_indices(self) -> torch.Tensor:
        """[C, 2] int64 (prefill sequence, chunk within it) of every ``KDA_CHUNK``-token chunk of the
        non-decode sequences: fla's ``chunk_indices``, built here from the host lengths once a step.
        fla's own helper ends in a blocking host-to-device copy, a stream sync in every eager prefill
        step (bench/check_host_syncs.py, RESULTS.md thirty-sixth session)."""
        counts = torch.tensor([-(-n // KDA_CHUNK) for n in self.query_lens_host[self.num_decodes:]], dtype=torch.int64)
        return to_device(torch.stack(_segments(counts), 1), self.query_start.device)

    @cached_property
    def prefill_latents(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The non-decode sequences' latent rows (cached + new) back to back, for every MLA layer's
        one-launch prefill (``mla_prefill_varlen``): (page [sum S], offset in page [sum S],
        sequences [P, 4] int32 (first query row, first latent row, context, new tokens), the
        longest new-token count). Built once a step from the host lengths (no device sync); in a
        static prefill step on the device from the static tensors, the row count and the longest
        count bounded (``_static_prefill_latents``)."""
        if self.static_shapes:
            return self._static_prefill_latents()
        nd = self.num_decodes
        cu = self.prefill_cu_seqlens[1]
        new = cu.diff()
        ctx = torch.tensor(self.context_lens_host[nd:], dtype=torch.int64)
        keys = ctx + new
        seq, pos = _segments(keys)
        seq = seq + nd
        seqs = torch.stack([cu[:-1], keys.cumsum(0) - keys, ctx, new], 1).to(torch.int32)
        dev = self.block_table.device
        seq, pos = to_device(seq, dev), to_device(pos, dev)
        page = self.block_table[seq, pos // self.page_size]
        return page, pos % self.page_size, to_device(seqs, dev), int(new.max())

    def _static_prefill_latents(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``prefill_latents`` from the device tensors alone (sizes static: a captured step): rows
        past the sequences' own (up to ``static_latent_rows``) read page 0 and are never attended."""
        nd = self.num_decodes
        qs = self.prefill_cu_seqlens[0]
        new = qs.diff()
        ctx = self.context_lens[nd:]
        starts = torch.cat([qs[:1], (ctx + new).cumsum(0)])  # first latent row of each sequence (qs[0] = 0)
        rows = torch.arange(self.static_latent_rows or self.num_tokens - nd, device=qs.device)
        seq = (torch.searchsorted(starts, rows, right=True) - 1).clamp(max=new.shape[0] - 1)
        pos = rows - starts[seq]
        table = self.block_table[nd:]
        col = (pos // self.page_size).clamp(max=table.shape[1] - 1)
        page = torch.where(rows < starts[-1], table[seq, col], 0).clamp_min(0)
        seqs = torch.stack([qs[:-1], starts[:-1], ctx, new], 1).to(torch.int32)
        return page, pos % self.page_size, seqs, self.num_tokens - nd

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_host)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @classmethod
    def build(cls, chunks: Sequence[SeqChunk], page_size: int = 64, device=None) -> "ForwardBatch":
        """Host lists -> device tensors: C-level concatenation and vectorised index math, no
        per-token Python loop (this runs every engine step)."""
        if not chunks:
            raise ValueError("a forward batch needs at least one sequence")
        n = len(chunks)
        qlens = [len(c.token_ids) for c in chunks]
        ctx = [c.context_len for c in chunks]
        npages = [len(c.pages) for c in chunks]
        if min(qlens) < 1:
            raise ValueError("every sequence in a step needs at least one new token")
        for c, q, p in zip(chunks, qlens, npages):
            if p * page_size < c.context_len + q:
                raise ValueError(f"sequence with {c.context_len}+{q} tokens needs "
                                 f"{-(-(c.context_len + q) // page_size)} pages of {page_size}, got {p}")
        num_decodes = 0
        while num_decodes < n and qlens[num_decodes] == 1:
            num_decodes += 1
        ids = torch.tensor(list(chain.from_iterable(c.token_ids for c in chunks)), dtype=torch.int64)
        npages_t = torch.tensor(npages, dtype=torch.int64)
        table = torch.full((n, max(npages)), -1, dtype=torch.int64)
        rows, cols = _segments(npages_t)
        table[rows, cols] = torch.tensor(list(chain.from_iterable(c.pages for c in chunks)), dtype=torch.int64)
        qlen_t = torch.tensor(qlens, dtype=torch.int64)
        ctx_t = torch.tensor(ctx, dtype=torch.int64)
        qstart = torch.zeros(n + 1, dtype=torch.int64)
        qstart[1:] = qlen_t.cumsum(0)
        seq_of_token = torch.repeat_interleave(torch.arange(n), qlen_t)
        pos = ctx_t[seq_of_token] + torch.arange(len(ids)) - qstart[seq_of_token]
        slot_mapping = table[seq_of_token, pos // page_size] * page_size + pos % page_size
        to = lambda t: to_device(t, device) if device is not None else t  # noqa: E731  (no host sync)
        return cls(
            input_ids=to(ids),
            query_start=to(qstart),
            context_lens=to(ctx_t),
            seq_lens=to(ctx_t + qlen_t),
            kda_slots=to(torch.tensor([c.kda_slot for c in chunks], dtype=torch.int64)),
            block_table=to(table),
            slot_mapping=to(slot_mapping),
            logits_indices=to(qstart[1:] - 1),
            num_decodes=num_decodes,
            page_size=page_size,
            query_lens_host=qlens,
            context_lens_host=ctx,
        )

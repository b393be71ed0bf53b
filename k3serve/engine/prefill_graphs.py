"""Shape-static prefill steps of new prompts, captured as CUDA graphs per token bucket.

A short prompt's prefill step is host-bound: kimi-linear-48b's 512-token step launches ~800
kernels, 31 ms of GPU time in a 61-67 ms eager step (RESULTS.md seventeenth session). A step of
n new prompts (no cached context, each sampling its first token) of L tokens in all runs at the
smallest token bucket b > L: the tokens are copied into static buffers, and positions L..b form
one padding sequence on the pool's scratch slot, its latent rows all in the scratch page (its
outputs are never read, and it never touches a live sequence). Decode rows may lead the step
(continuous batching: a new prompt arrives while others decode), padded to a decode bucket d as
in engine/decode_graphs.py. The step's structure is static: d + n + 1 sequences, d + b tokens;
fla builds its chunk indices on the device (``use_graph``), MLA's one-launch prefill reads
device-built sequence rows (``ForwardBatch.prefill_latents``) and its decode attends over the
block table's full width. On CUDA the graph captured for (d, n, b) replays the whole forward and
the d + n sampled rows' logits; without CUDA (or before capture) the same padded step runs
eagerly, which is how the CPU tests check it.

Prompts on cached context (a prefix-cache hit: a chat's or an agent's next turn) join where context
buckets are asked for (``max_context``; the engine's default 32,768): a step of such prompts (no
decode rows, unless ``context_decodes``) then runs at the smallest context bucket c >= their
contexts' sum, its MLA prefill over c + b latent rows (``ForwardBatch.static_latent_rows``) and
fla from the slots' states (zeros where a prompt is new). Decode rows before such prompts pad to
the largest decode bucket only: one decode shape per (token bucket, context bucket), 18 graphs at
the engine's defaults where every decode bucket would be 90; a padding row costs ~50 us in a step
of 128+ tokens (kimi-linear-48b: 16 rows 12.0 ms replayed, 1 row 11.2). Other steps stay eager.

A replay costs the bucket's GPU time; an eager step of fewer tokens its own launches and GPU
time. Where the model is GPU-bound at a size, the padding costs more than the launches saved (K3
slice: 1,100 tokens 35 ms eager, 41.5 ms replayed at 1,536). So after capture every key's replay
and eager step are timed; a step runs static only where the replay beats the eager time
interpolated between the key's bucket and the one below at the step's token count, and a key
whose replay does not beat even its own bucket's eager step is dropped.
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
from .decode_graphs import (StaticInputs, bucket_sizes, capture_blockers, capture_graphs, fill_decode_rows, page_major,
                            write_pages)

log = logging.getLogger(__name__)


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


def token_buckets(max_tokens: int, smallest: int = 128, halves_from: int | None = 512) -> list[int]:
    """Powers of two from ``smallest`` up to ``max_tokens`` (itself last), and from ``halves_from``
    on the 1.5x sizes between them: padding at most doubles a short step, whose cost is launches,
    but only adds half a longer one, whose cost is tokens (K3 slice: 1,100 tokens padded to 2,048
    took 48 ms replayed against 35 ms eager; RESULTS.md eighteenth session)."""
    sizes, b = [], smallest
    while b < max_tokens:
        sizes.append(b)
        if halves_from is not None and b >= halves_from and b * 3 // 2 < max_tokens:
            sizes.append(b * 3 // 2)
        b *= 2
    return sizes + [max_tokens]


# Context buckets (prompts on cached context) start here, as powers of two.
CONTEXT_SMALLEST = 1024

# Steps with decode rows are captured for token buckets up to this size only (5 decode buckets x 3
# token buckets more graphs, ~1 s of capture each): past it a step's GPU time grows toward the
# host's.
MIXED_MAX_TOKENS = 512


class PrefillGraphs:
    def __init__(self, model: K3ForCausalLM, pool: UnifiedPool, max_tokens: int = 2048, max_seqs: int = 1,
                 max_decodes: int = 0, max_pages: int = 0, capture: bool = True, buckets: list[int] | None = None,
                 mixed_max_tokens: int = MIXED_MAX_TOKENS, max_context: int = 0, timed: bool = True,
                 context_decodes: bool = False):
        """``max_decodes``: decode rows a step may lead with (0: none); ``max_pages``: the block
        table's width (a decode row's or a cached prompt's pages; the engine's max_model_len);
        ``max_context``: the largest context bucket for prompts on cached context (0: none);
        ``timed``: after capture, time every key's replay and eager step (``time_all``) and take
        a step static only where the replay is the faster (``faster``);
        ``context_decodes``: decode rows may lead prompts on cached context too (a multi-user
        chat's next turn), padded to the largest decode bucket (mixed token buckets x context
        buckets more graphs)."""
        if max_seqs < 1 or max_tokens < 2 or max_decodes < 0:
            raise ValueError(f"prefill graphs need max_seqs >= 1, max_tokens >= 2 and max_decodes >= 0, "
                             f"got {max_seqs}, {max_tokens}, {max_decodes}")
        self.model, self.pool = model, pool
        self.page_size = ps = pool.layout.page_size
        self.buckets = sorted(buckets) if buckets else token_buckets(max_tokens)
        self.decode_buckets = [0] + (bucket_sizes(max_decodes) if max_decodes else [])
        self.max_seqs, self.mixed_max_tokens, self.context_decodes = max_seqs, mixed_max_tokens, context_decodes
        B, D, S = self.buckets[-1], self.decode_buckets[-1], max_seqs + 1  # S: the prompts and the padding
        self.context_buckets = [0] + (token_buckets(max_context, CONTEXT_SMALLEST, None) if max_context else [])
        self.max_pages = max(max_pages, -(-(B + self.context_buckets[-1]) // ps))
        self._fields = ("input_ids", "context_lens", "seq_lens", "kda_slots", "slot_mapping")
        self.inputs = StaticInputs(pool.buffer.device, dict(
            input_ids=D + B, context_lens=D + S, seq_lens=D + S, kda_slots=D + S, slot_mapping=D + B,
            query_start=D + S + 1, logits_indices=D + max_seqs, block_table=(D + S) * self.max_pages))
        self.dev = self.inputs.dev
        self.graphs: dict[tuple[int, int, int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int, int, int], torch.Tensor] = {}
        # key -> (replay ms, eager step ms) as measured after capture (none: every fitting step is static)
        self.timings: dict[tuple[int, int, int, int], tuple[float, float]] = {}
        if capture:
            self._capture_all()
            if timed:
                try:
                    self.set_timings(self.time_all())
                except RuntimeError as exc:  # (timing is an optimisation: untimed, every fitting step is static)
                    log.warning("prefill graphs: timing after capture failed, all kept: %s", exc)

    # ---- per step -------------------------------------------------------------------------
    def bucket_for(self, tokens: int, decodes: int = 0) -> int | None:
        cap = self.mixed_max_tokens if decodes else self.buckets[-1]
        return next((b for b in self.buckets if tokens < b <= cap), None)  # < : the padding has a token

    def decode_bucket_for(self, decodes: int, context: int = 0) -> int | None:
        return next((d for d in self.decode_buckets_with(context) if d >= decodes), None)

    def decode_buckets_with(self, context: int) -> list[int]:
        """The decode buckets a step whose prompts are in context bucket ``context`` may take: all
        for new prompts; before prompts on cached context, none, or with ``context_decodes`` the
        largest alone (one decode shape per token and context bucket)."""
        if not context:
            return self.decode_buckets
        return [0] + self.decode_buckets[-1:] if self.context_decodes and len(self.decode_buckets) > 1 else [0]

    def _split(self, chunks: list[SeqChunk]) -> tuple[int, int, int, int] | None:
        """(real decode rows, decode bucket, token bucket, context bucket) where the step fits,
        else None: decode rows (one token on cached context) first, then 1..max_seqs prompts of 2+
        tokens (a one-token prompt is a decode row in the eager step, run by the decode kernels;
        here it would take the prefill ones), new ones, or on cached context within a context
        bucket (``decode_buckets_with``)."""
        nd = 0
        while nd < len(chunks) and len(chunks[nd].token_ids) == 1 and chunks[nd].context_len > 0:
            nd += 1
        prompts = chunks[nd:]
        if not 1 <= len(prompts) <= self.max_seqs or any(len(c.token_ids) < 2 for c in prompts):
            return None
        if any(c.context_len >= self.max_pages * self.page_size for c in chunks[:nd]):
            return None
        context = sum(c.context_len for c in prompts)
        c = next((c for c in self.context_buckets if c >= context), None)
        d = None if c is None else self.decode_bucket_for(nd, c)
        tokens = sum(len(p.token_ids) for p in prompts)
        b = self.bucket_for(tokens, d or 0)
        if d is None or b is None or not self.faster((d, len(prompts), b, c), tokens):
            return None
        return nd, d, b, c

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return self._split(chunks) is not None

    def _fill_host(self, chunks: list[SeqChunk], nd: int, d: int, b: int) -> tuple[list[int], list[int], int]:
        """Write the step's inputs into the host buffer: decode rows padded to d, then the prompts'
        tokens padded to b (each prompt's rows of the block table cover its context too). Returns
        the sequences' (token counts, context lengths) and the table's used width (pages)."""
        ps, pool, h = self.page_size, self.pool, self.inputs.host()
        table = page_major(h["block_table"], d + len(chunks) - nd + 1, self.max_pages)
        ids, ctx, seq, slots, mapping = (h[f] for f in self._fields)
        ctx_list, decode_width = fill_decode_rows(pool, chunks[:nd], d, ids, ctx, seq, slots, mapping, table)
        prompts = chunks[nd:]
        n, lens, pctx = len(prompts), [len(c.token_ids) for c in prompts], [c.context_len for c in prompts]
        L = sum(lens)
        npages = np.array([-(-(q + c) // ps) for q, c in zip(lens, pctx)], np.int64)
        for c, p, q in zip(prompts, npages, lens):
            if len(c.pages) < p:
                raise ValueError(f"sequence with {c.context_len}+{q} tokens needs {p} pages of {ps}, got {len(c.pages)}")
        write_pages(pool, table, d, prompts, npages, np.array([c.kda_slot for c in prompts], np.int64))
        ids[d:d + L] = list(chain.from_iterable(c.token_ids for c in prompts))
        ids[d + L:d + b] = 0
        qs = h["query_start"]
        qs[:d + 1] = np.arange(d + 1)
        qs[d + 1:d + n + 1] = d + np.cumsum(lens)
        qs[d + n + 1] = d + b
        ctx[d:d + n], ctx[d + n] = pctx, 0
        seq[d:d + n], seq[d + n] = np.add(lens, pctx), b - L
        slots[d:d + n], slots[d + n] = [c.kda_slot for c in prompts], pool.scratch_slot
        h["logits_indices"][:d] = np.arange(d)
        h["logits_indices"][d:d + n] = qs[d + 1:d + n + 1] - 1
        pad_pages = -(-(b - L) // ps)
        table[d + n, :pad_pages] = pool.scratch_page  # the padding sequence: every position in the scratch page
        seq_of = d + np.repeat(np.arange(n), lens)
        pos = np.arange(L) - np.repeat(qs[d:d + n] - d, lens) + np.repeat(pctx, lens)
        mapping[d:d + L] = table[seq_of, pos // ps] * ps + pos % ps
        mapping[d + L:d + b] = pool.scratch_page * ps + np.arange(b - L) % ps
        width = max(pad_pages, int(npages.max()), decode_width)
        return [1] * d + lens + [b - L], ctx_list + pctx + [0], width

    def run(self, chunks: list[SeqChunk], fixup: tuple | None = None) -> torch.Tensor:
        """fp32 logits [len(chunks), V]: each decode row's and each prompt's last token, in
        ``chunks`` order (``fits(chunks)`` must hold). ``fixup``: as ``DecodeGraphs.run`` (flat
        positions of the unpadded step: decode rows lead, so only theirs can be pending)."""
        nd, d, b, c = self._split(chunks)
        n = len(chunks) - nd
        qlens, ctx, width = self._fill_host(chunks, nd, d, b)
        self.inputs.upload((d + n + 1) * width, fixup)
        key = (d, n, b, c)
        if key in self.graphs:
            self.graphs[key].replay()
            out = self.outputs[key]
        else:
            out = self._forward(self._static_batch(*key, qlens, ctx))
        return out if nd == d else torch.cat([out[:nd], out[d:]])

    # ---- capture --------------------------------------------------------------------------
    def _static_batch(self, d: int, n: int, b: int, c: int, qlens: list[int], ctx: list[int]) -> ForwardBatch:
        dv, S, T = self.dev, d + n + 1, d + b
        return ForwardBatch(
            input_ids=dv["input_ids"][:T], query_start=dv["query_start"][:S + 1], context_lens=dv["context_lens"][:S],
            seq_lens=dv["seq_lens"][:S], kda_slots=dv["kda_slots"][:S],
            block_table=page_major(dv["block_table"], S, self.max_pages), slot_mapping=dv["slot_mapping"][:T],
            logits_indices=dv["logits_indices"][:d + n], num_decodes=d, page_size=self.page_size,
            query_lens_host=qlens, context_lens_host=ctx, static_shapes=True, static_latent_rows=c + b if c else None)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        with torch.inference_mode():
            hidden = self.model(batch, self.pool.handles)
            return self.model.compute_logits(hidden[batch.logits_indices])

    def _capture_all(self) -> None:
        """Largest first. The buffers hold a step all on the scratch slot and page while capturing
        (decode rows and prompts on one token of context where the key has context, else without),
        so warm-up runs touch no live state; the host lists say "context" for the decode rows, as
        DecodeGraphs' capture does (no fresh rows baked in), and for a context key's prompts."""
        self.graphs, self.outputs = capture_graphs({k: (lambda k=k: self._scratch_forward(k)) for k in self.keys()},
                                                   "prefill", prepare=lambda key: self._fill_scratch(*key))

    def keys(self) -> list[tuple[int, int, int, int]]:
        """Every (decode bucket, prompts, token bucket, context bucket) a step can take, largest first."""
        return [(d, n, b, c) for c in reversed(self.context_buckets) for b in reversed(self.buckets)
                for d in reversed(self.decode_buckets_with(c)) for n in range(1, self.max_seqs + 1)
                if n < b and (d == 0 or b <= self.mixed_max_tokens)]

    def _scratch_forward(self, key: tuple[int, int, int, int]) -> torch.Tensor:
        """The static step of ``key`` on the scratch buffers (``_fill_scratch``), eagerly."""
        d, n, b, c = key
        return self._forward(self._static_batch(d, n, b, c, [1] * (d + n) + [b - n], [1] * d + [int(c > 0)] * n + [0]))

    def time_all(self, repeats: int = 2) -> dict[tuple[int, int, int, int], tuple[float, float]]:
        """Each captured key's (replay ms, eager step ms), the best of up to ``repeats``, on the
        scratch buffers (live state untouched): the replay between CUDA events, the eager step from
        its first launch to its end with the GPU drained first (the engine's eager step of the same
        shape has a little more host work: the comparison leans toward eager). A key whose replay
        takes under half its eager step is not timed again (kimi-linear-48b: every key, host-bound)."""
        timings, started = {}, time.perf_counter()
        for key, graph in self.graphs.items():
            self._fill_scratch(*key)
            eager, gpu = [], []
            while len(eager) < repeats and not (gpu and min(gpu) < 0.5 * min(eager)):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                self._scratch_forward(key)
                torch.cuda.synchronize()
                eager.append((time.perf_counter() - t0) * 1e3)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                gpu.append(start.elapsed_time(end))
            timings[key] = (min(gpu), min(eager))
        log.info("prefill graphs: %d timed in %.1f s", len(timings), time.perf_counter() - started)
        return timings

    def set_timings(self, timings: dict[tuple[int, int, int, int], tuple[float, float]]) -> None:
        """Take ``time_all``'s figures; drop the keys whose replay is not below their own eager
        step (the most tokens the key serves): no step of theirs would run static."""
        self.timings.update(timings)
        dropped = {k: v for k, v in timings.items() if v[0] >= v[1]}
        for k in dropped:
            self.graphs.pop(k, None)
            self.outputs.pop(k, None)
        if dropped:
            log.info("prefill graphs not faster than their eager steps, run eagerly (replay ms, eager ms): %s",
                     {k: tuple(round(x, 1) for x in v) for k, v in sorted(dropped.items())})

    def faster(self, key: tuple[int, int, int, int], tokens: int) -> bool:
        """Whether a step of ``tokens`` prompt tokens under ``key`` is faster replayed: its eager
        time is taken between the key's bucket's and the next smaller bucket's (same decode rows,
        prompts and context; the smallest bucket: its own), linear in the tokens. Untimed keys
        (no CUDA, or ``timed`` off): yes; dropped ones: no."""
        if key not in self.timings:
            return True
        if key not in self.graphs:
            return False
        d, n, b, c = key
        replay, eager = self.timings[key]
        below = [x for x in self.buckets if x < b and (d, n, x, c) in self.timings]
        if below:
            b0 = below[-1]
            eager0 = self.timings[(d, n, b0, c)][1]
            eager = eager0 + (eager - eager0) * max(0, tokens - b0) / (b - b0)
        return replay < eager

    def _fill_scratch(self, d: int, n: int, b: int, c: int) -> None:
        """The device buffers of a step of d decode rows and n one-token prompts (on one token of
        context where c > 0) and the padding, all on the scratch slot and page (ids past the pool's
        allocatable range: no check_ids)."""
        dv, ps, dev = self.dev, self.page_size, self.dev["input_ids"].device
        S, T, pc = d + n + 1, d + b, int(c > 0)
        dv["input_ids"][:T].zero_()
        dv["context_lens"][:S].copy_(torch.tensor([0] * d + [pc] * n + [0], device=dev))
        dv["query_start"][:S + 1].copy_(torch.tensor([*range(d + n + 1), T], device=dev))
        dv["seq_lens"][:S].copy_(torch.tensor([1] * d + [1 + pc] * n + [b - n], device=dev))
        dv["kda_slots"][:S].fill_(self.pool.scratch_slot)
        dv["logits_indices"][:d + n].copy_(torch.arange(d + n, device=dev))
        page_major(dv["block_table"], S, self.max_pages).fill_(self.pool.scratch_page)
        dv["slot_mapping"][:T].copy_(self.pool.scratch_page * ps + torch.arange(T, device=dev) % ps)

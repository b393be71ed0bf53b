"""Turns a scheduled step into the model's flat batch and runs it over the pool's cache views."""

from __future__ import annotations

import time
import torch

from ..cache.pool import UnifiedPool
from ..model.batch import ForwardBatch, SeqChunk
from ..model.k3 import K3ForCausalLM
from .decode_graphs import DecodeGraphs
from .prefill_graphs import PrefillGraphs
from .prompt_logprobs import rows_to_score, score_chunks
from .transfer import fill_pending_tokens, to_device
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: K3ForCausalLM, pool: UnifiedPool, graphs: DecodeGraphs | None = None,
                 prefill_graphs: PrefillGraphs | None = None):
        self.model = model
        self.pool = pool
        self.graphs = graphs  # shape-static decode steps (CUDA graphs), None: always eager
        self.prefill_graphs = prefill_graphs  # the same for steps of new prompts
        self.device = next(model.parameters()).device
        self.timings = {"prepare": 0.0, "forward": 0.0}
        self.graph_steps = 0
        self.prefill_graph_steps = 0
        self.eager_steps = 0
        # What the steps computed: prompt (or recomputed) tokens and the steps that had any, and
        # decode tokens (one a running sequence). A wave of prompts split over several prefill
        # steps shows here (each such step reads all the expert weights).
        self.prefill_steps = 0
        self.scheduled_tokens = {"prefill": 0, "decode": 0}
        # Benchmarks only: wait for the device after each forward so its time is charged to
        # "forward", not to the first host sync after it (the sampler's). Costs the overlap.
        self.sync_timings = False

    def _forward_done(self) -> None:
        if self.sync_timings and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def chunks(sched: list[ScheduledSeq]) -> list[SeqChunk]:
        return [SeqChunk(s.seq.token_ids[s.seq.num_computed: s.seq.num_computed + s.num_tokens],
                         s.seq.num_computed, s.seq.kda_slot, s.seq.pages) for s in sched]

    def build_batch(self, sched: list[ScheduledSeq]) -> ForwardBatch:
        return ForwardBatch.build(self.chunks(sched), self.pool.layout.page_size, self.device)

    @torch.inference_mode()
    def execute(self, sched: list[ScheduledSeq], fixup: tuple | None = None, score: bool = False) -> torch.Tensor:
        """Runs the step; returns fp32 logits [num sampling sequences, V] in ``sched`` order.
        ``fixup`` = (flat positions, rows, tokens on the device): input tokens the previous step
        sampled that the host has not read yet (overlapped scheduling), copied in on the device.
        ``score``: some request asks for prompt logprobs; rows of its prompt are scored into their
        sequences, in an eager step."""
        t0 = time.perf_counter()
        decode = sum(s.num_tokens == 1 and s.seq.num_computed >= s.seq.num_prompt for s in sched)
        prefill = sum(s.num_tokens for s in sched) - decode
        self.prefill_steps += prefill > 0
        self.scheduled_tokens["prefill"] += prefill
        self.scheduled_tokens["decode"] += decode
        scoring = score and any(rows_to_score(s) is not None for s in sched)
        if (self.graphs is not None or self.prefill_graphs is not None) and not scoring:
            chunks = self.chunks(sched)
            sampling = all(s.samples for s in sched)
            static = (self.graphs if self.graphs is not None and sampling and self.graphs.fits(chunks) else
                      self.prefill_graphs if self.prefill_graphs is not None and self.prefill_graphs.fits(chunks)
                      else None)
            if static is not None:
                logits = static.run(chunks, fixup)
                if not sampling:  # (a prompt's chunk before its last: its logits unused)
                    logits = logits[to_device([i for i, s in enumerate(sched) if s.samples], self.device)]
                self._forward_done()
                self.timings["forward"] += time.perf_counter() - t0
                self.graph_steps += static is self.graphs
                self.prefill_graph_steps += static is self.prefill_graphs
                return logits
        self.eager_steps += 1
        batch = self.build_batch(sched)
        fill_pending_tokens(batch.input_ids, fixup)
        want = to_device([i for i, s in enumerate(sched) if s.samples], self.device)
        t1 = time.perf_counter()
        hidden = self.model(batch, self.pool.handles)
        if scoring:
            score_chunks(self.model, hidden, sched)
        logits = self.model.compute_logits(hidden[batch.logits_indices[want]])
        self._forward_done()
        t2 = time.perf_counter()
        self.timings["prepare"] += t1 - t0
        self.timings["forward"] += t2 - t1
        return logits

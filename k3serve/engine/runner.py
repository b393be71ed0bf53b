"""Turns a scheduled step into the model's flat batch and runs it over the pool's cache views."""

from __future__ import annotations

import time
import torch

from ..cache.pool import UnifiedPool
from ..model.batch import ForwardBatch, SeqChunk
from ..model.k3 import K3ForCausalLM
from .scheduler import ScheduledSeq


class ModelRunner:
    def __init__(self, model: K3ForCausalLM, pool: UnifiedPool):
        self.model = model
        self.pool = pool
        self.device = next(model.parameters()).device
        self.timings = {"prepare": 0.0, "forward": 0.0}

    def build_batch(self, sched: list[ScheduledSeq]) -> ForwardBatch:
        chunks = [SeqChunk(s.seq.token_ids[s.seq.num_computed: s.seq.num_computed + s.num_tokens],
                           s.seq.num_computed, s.seq.kda_slot, s.seq.pages) for s in sched]
        return ForwardBatch.build(chunks, self.pool.layout.page_size, self.device)

    @torch.inference_mode()
    def execute(self, sched: list[ScheduledSeq]) -> torch.Tensor:
        """Runs the step; returns fp32 logits [num sampling sequences, V] in ``sched`` order."""
        t0 = time.perf_counter()
        batch = self.build_batch(sched)
        want = torch.tensor([i for i, s in enumerate(sched) if s.samples], dtype=torch.int64, device=self.device)
        t1 = time.perf_counter()
        hidden = self.model(batch, self.pool.handles)
        logits = self.model.compute_logits(hidden[batch.logits_indices[want]])
        t2 = time.perf_counter()
        self.timings["prepare"] += t1 - t0
        self.timings["forward"] += t2 - t1
        return logits

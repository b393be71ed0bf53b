"""Continuous batching over the unified pool (design.md "Scheduling").

Each step: running sequences first, in admission order (decode steps and continuing prefill
chunks), then FCFS admission of waiting ones, all under a token budget and a sequence cap. A
sequence holds one KDA slot and the MLA pages covering its computed tokens; pages are taken as
tokens are scheduled. When the pool cannot grow, the most recently admitted running sequence is
preempted by recompute (its cache freed, its tokens kept; on readmission it prefills them again
and continues exactly where it was). The oldest running sequence is never preempted for a younger
one, so the batch always makes progress. Under the ``priority`` policy (vLLM's --scheduling-policy
priority) "oldest" reads "first by (priority, arrival)": waiting sequences are admitted in that
order, running ones are scheduled in it, and the last of them is the one preempted; a waiting
sequence waits for memory rather than preempting (as vLLM's). With prefix caching, admission
first restores the best checkpoint (cache/prefix.py), prefill chunks end on checkpoint
boundaries, and cached checkpoints are evicted before any running sequence is preempted.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

from ..cache.owners import PoolOwners
from ..cache.pool import UnifiedPool
from ..cache.prefix import PrefixCache
from .request import Sequence, Status


class RequestRejected(ValueError):
    """A request that can never run (too long for the model or for the whole pool)."""


def check_prompt_length(prompt_len: int, max_model_len: int) -> None:
    if prompt_len < 1:
        raise RequestRejected("the prompt is empty: at least one token is needed")
    if prompt_len >= max_model_len:
        raise RequestRejected(f"the prompt has {prompt_len} tokens; max_model_len is {max_model_len} "
                              "(prompt plus at least one generated token must fit)")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # new tokens computed this step, starting at seq.num_computed

    @property
    def samples(self) -> bool:
        """The chunk reaches the last known token, so its logits give the next token."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


class Scheduler:
    def __init__(self, pool: UnifiedPool, max_num_batched_tokens: int = 8192, max_num_seqs: int = 256,
                 max_model_len: int = 65536, prefix: PrefixCache | None = None, owners: PoolOwners | None = None,
                 policy: str = "fcfs"):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {policy!r}")
        self.policy = policy
        self.pool = pool
        self.owners = owners or PoolOwners(pool)
        self.prefix = prefix
        self.page_size = pool.layout.page_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.finished_by_scheduler: list[Sequence] = []  # ended inside schedule(); the engine reports them

    # ---- admission control ----------------------------------------------------------------
    def check_admissible(self, prompt_len: int) -> None:
        check_prompt_length(prompt_len, self.max_model_len)
        pages = -(-(prompt_len + 1) // self.page_size)
        if not self.pool.fits_alone(1, pages):
            raise RequestRejected(f"the prompt needs {pages} MLA pages plus one KDA slot, more than the whole "
                                  f"cache pool ({self.pool.total_bytes / 2**30:.2f} GiB) holds")

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq.num_prompt)
        self.enqueue(seq, preempted=False)

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, float]:
        return seq.priority, seq.arrival

    def enqueue(self, seq: Sequence, preempted: bool) -> None:
        """To the waiting queue: FCFS puts a preempted (or unforked) sequence first, a new one
        last; the priority policy keeps the queue in (priority, arrival) order."""
        seq.status = Status.WAITING
        if self.policy == "priority":
            self.waiting.insert(bisect.bisect_right(self.waiting, self._rank(seq), key=self._rank), seq)
        elif preempted:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- memory ---------------------------------------------------------------------------
    def _pages_needed(self, seq: Sequence, upto: int) -> int:
        return max(0, -(-upto // self.page_size) - len(seq.pages))

    def _grow(self, seq: Sequence, upto: int) -> bool:
        """Give ``seq`` the slot and pages covering tokens [0, upto), evicting cached checkpoints
        if needed; False if the pool is still full."""
        need_slot = int(seq.kda_slot is None)
        need_pages = self._pages_needed(seq, upto)
        if not self.owners.can_allocate(slots=need_slot, pages=need_pages):
            if self.prefix is None or not self.prefix.make_room(need_slot, need_pages):
                return False
        if need_slot:
            self.owners.alloc_slot(seq)
        for _ in range(need_pages):
            self.owners.alloc_page(seq)
        return True

    def release(self, seq: Sequence) -> None:
        """Return a sequence's slot and page references to the pool at once."""
        self.owners.release(seq)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.pending_checkpoint = False  # its state is about to be lost; recompute takes it again
        self.release(seq)
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.enqueue(seq, preempted=True)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if self.prefix is None or not self.prefix.on_finish(seq):
            self.release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = seq.finish_reason or reason

    def after_step(self, seq: Sequence, computed: int) -> None:
        if self.prefix is not None:
            self.prefix.after_step(seq, computed)

    # ---- one step -------------------------------------------------------------------------
    def _chunk(self, seq: Sequence, budget: int) -> int:
        n = min(seq.num_tokens - seq.num_computed, budget)
        if self.prefix is not None:
            boundary = self.prefix.next_boundary(seq)
            if boundary is not None:
                n = min(n, boundary - seq.num_computed)
        return n

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        if self.policy == "priority":
            self.running.sort(key=self._rank)  # (stable: equal ranks keep admission order)
        i = 0
        while i < len(self.running) and budget > 0 and len(out) < self.max_num_seqs:
            seq = self.running[i]
            if seq.awaiting_final:  # overlap: its last token is on the way and ends it; nothing to run
                i += 1
                continue
            if self.prefix is not None:
                self.prefix.before_step(seq)  # a pending turn checkpoint is copied before it is overwritten
            n = self._chunk(seq, budget)
            while not self._grow(seq, seq.num_computed + n):
                victim = self.running[-1]
                if victim is seq and i == 0:
                    # Alone and still cannot grow: the cache cannot hold a longer sequence.
                    self.finish(seq, "length")
                    self.finished_by_scheduler.append(seq)
                    seq = None
                    break
                self.preempt(victim)
                if victim is seq:
                    seq = None
                    break
            if seq is None:
                continue  # the list shifted; index i now holds the next sequence (or nothing)
            out.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(out) < self.max_num_seqs:
            seq = self.waiting[0]
            reused = 0
            restorable = seq.num_computed == 0 and seq.kda_slot is None and not seq.scoring_prompt
            if restorable and self.prefix is not None:
                reused = self.prefix.restore(seq)
            n = self._chunk(seq, budget)
            if not self._grow(seq, seq.num_computed + n):
                self.release(seq)  # give back what the restore took; FCFS: nobody overtakes the head
                seq.num_computed = 0
                break
            if self.prefix is not None:
                self.prefix.admitted(reused)
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = reused
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.append(ScheduledSeq(seq, n))
            budget -= n
        # Decode steps (one token) first: the model batches them as one slice.
        out.sort(key=lambda s: s.num_tokens != 1)
        return out

"""Prefix caching over both cache kinds (seeds 000/002/003, design.md "Prefix caching").

KDA state is overwritten by every token, so it cannot be shared live: the cache keeps read-only
*checkpoints* (a pool slot holding every KDA layer's state at some token position) together with
references to the MLA pages covering the tokens before that position. A request that hits copies
the checkpoint's state into its own working slot (copy-on-write), shares the checkpoint's full
MLA pages by reference count and copies the partially filled last page (it will append to it).
A checkpoint visible to others is never written.

Keys are chained hashes over fine hash blocks (default 512 tokens, independent of the 64-token
page). Checkpoints sit at hash-block boundaries inside long prefills and at each prompt's end
(a turn boundary, generally not block-aligned: it is keyed by the chain of its full blocks plus
its tail tokens). The hit is the longest checkpoint whose tokens prefix the new prompt while
leaving at least one prompt token to compute; with only block-aligned checkpoints this is
exactly seed 003's rule (cache/hit_rule.py).
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field


def chain_hashes(tokens: list[int], block: int, n_blocks: int, seed: bytes = b"") -> list[bytes]:
    """h_i = H(h_{i-1} || tokens of block i) for the first ``n_blocks`` full blocks (h_0: ``seed``)."""
    out, prev = [], seed
    for i in range(n_blocks):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(str(tokens[i * block:(i + 1) * block]).encode())
        prev = h.digest()
        out.append(prev)
    return out


_tick = itertools.count()


def _salt(seq) -> str | None:
    return seq.params.cache_salt


@dataclass(eq=False)
class Checkpoint:
    """A read-only snapshot: ``kda_slot`` holds the KDA state after ``pos`` tokens; ``pages``
    cover tokens [0, pos). Holder protocol shared with Sequence: ``kda_slot`` and ``pages``."""

    pos: int
    turn_end: bool
    kda_slot: int | None = None
    pages: list[int] = field(default_factory=list)
    chain: bytes = b""
    tail: tuple[int, ...] = ()
    last_used: int = field(default_factory=lambda: next(_tick))

    def touch(self) -> None:
        self.last_used = next(_tick)


class PrefixIndex:
    """Where checkpoints are found. Memory (slots, pages, refcounts) stays with the scheduler."""

    def __init__(self, block_size: int = 512):
        self.block = block_size
        self.aligned: dict[bytes, Checkpoint] = {}  # chain hash of k full blocks -> checkpoint at k*block
        self.tails: dict[bytes, list[Checkpoint]] = {}  # chain hash of k blocks -> checkpoints at k*block + t

    def __len__(self) -> int:
        return len(self.aligned) + sum(len(v) for v in self.tails.values())

    def checkpoints(self) -> list[Checkpoint]:
        return list(self.aligned.values()) + [c for v in self.tails.values() for c in v]

    @staticmethod
    def seed(salt: str | None) -> bytes:
        """The chains' start: a request's ``cache_salt`` (vLLM's) keeps its checkpoints from matching
        any other salt's, or none's (tenants do not share, or time, each other's prefixes)."""
        return b"" if salt is None else hashlib.blake2b(salt.encode(), digest_size=16, person=b"k3-salt").digest()

    def key(self, tokens: list[int], pos: int, salt: str | None = None) -> tuple[bytes, tuple[int, ...]]:
        k = pos // self.block
        chain = chain_hashes(tokens, self.block, k, self.seed(salt))[-1] if k else self.seed(salt)
        return chain, tuple(tokens[k * self.block: pos])

    def contains(self, tokens: list[int], pos: int, salt: str | None = None) -> bool:
        chain, tail = self.key(tokens, pos, salt)
        if not tail:
            return chain in self.aligned
        return any(c.tail == tail for c in self.tails.get(chain, ()))

    def add(self, ckpt: Checkpoint, tokens: list[int], salt: str | None = None) -> None:
        ckpt.chain, ckpt.tail = self.key(tokens, ckpt.pos, salt)
        if ckpt.tail:
            self.tails.setdefault(ckpt.chain, []).append(ckpt)
        else:
            self.aligned[ckpt.chain] = ckpt

    def remove(self, ckpt: Checkpoint) -> None:
        if ckpt.tail:
            lst = self.tails[ckpt.chain]
            lst.remove(ckpt)
            if not lst:
                del self.tails[ckpt.chain]
        else:
            del self.aligned[ckpt.chain]

    def match(self, tokens: list[int], salt: str | None = None) -> Checkpoint | None:
        """The longest checkpoint that prefixes ``tokens`` and leaves at least one token to compute."""
        limit = len(tokens) - 1
        if limit <= 0:
            return None
        chains = chain_hashes(tokens, self.block, limit // self.block, self.seed(salt))
        best: Checkpoint | None = None
        for k in range(len(chains), -1, -1):
            chain = chains[k - 1] if k else self.seed(salt)
            for c in self.tails.get(chain, ()):
                if c.pos <= limit and (best is None or c.pos > best.pos) and tuple(tokens[k * self.block: c.pos]) == c.tail:
                    best = c
            if k and chain in self.aligned and (best is None or k * self.block > best.pos):
                best = self.aligned[chain]
            if best is not None and best.pos >= k * self.block:
                break  # nothing shorter can beat it
        return best


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    tokens_prefilled: int = 0
    checkpoints_taken: int = 0
    checkpoints_handed_over: int = 0
    checkpoints_evicted: int = 0
    checkpoints_skipped: int = 0  # no room even after eviction

    def as_dict(self, held: int) -> dict:
        total = self.tokens_reused + self.tokens_prefilled
        return dict(lookups=self.lookups, hits=self.hits, hit_rate=self.tokens_reused / total if total else 0.0,
                    tokens_reused=self.tokens_reused, tokens_prefilled=self.tokens_prefilled, checkpoints_held=held,
                    checkpoints_taken=self.checkpoints_taken, checkpoints_handed_over=self.checkpoints_handed_over,
                    checkpoints_evicted=self.checkpoints_evicted, checkpoints_skipped=self.checkpoints_skipped)


class PrefixCache:
    """Checkpoint policy, copy-on-write restore, hand-over and LRU eviction over the shared pool."""

    def __init__(self, owners, block_size: int = 512, checkpoint_interval: int = 4096):
        if checkpoint_interval % block_size:
            raise ValueError(f"--kda-checkpoint-interval ({checkpoint_interval}) must be a multiple of "
                             f"--prefix-block-size ({block_size})")
        self.owners = owners
        self.pool = owners.pool
        self.page = self.pool.layout.page_size
        self.interval = checkpoint_interval
        self.index = PrefixIndex(block_size)
        self.stats = PrefixStats()

    # ---- requests ---------------------------------------------------------------------------
    def restore(self, seq) -> int:
        """On admission: copy the best checkpoint into the sequence's private slot and pages.
        Returns the tokens skipped (0 on a miss or when there is no room). Counted by
        ``admitted`` only once the sequence is really admitted (a head that must wait retries)."""
        ck = self.index.match(seq.token_ids, _salt(seq))
        if ck is None:
            return 0
        n_full, partial = divmod(ck.pos, self.page)
        if not self.make_room(1, int(partial > 0), protect=(ck,)):
            return 0
        self.owners.alloc_slot(seq)
        self.pool.copy_slot(ck.kda_slot, seq.kda_slot)
        for p in ck.pages[:n_full]:
            self.owners.share_page(seq, p)
        if partial:
            self.pool.copy_page(ck.pages[n_full], self.owners.alloc_page(seq))
        seq.num_computed = ck.pos
        ck.touch()
        return ck.pos

    def admitted(self, reused: int) -> None:
        self.stats.lookups += 1
        if reused:
            self.stats.hits += 1
            self.stats.tokens_reused += reused

    def next_boundary(self, seq) -> int | None:
        """Where the current prefill chunk must end so its final state can be checkpointed."""
        if seq.num_computed >= seq.num_prompt:
            return None
        nxt = (seq.num_computed // self.interval + 1) * self.interval
        return min(nxt, seq.num_prompt)

    def after_step(self, seq, computed: int) -> None:
        """After a chunk ran: count prefill work; checkpoint at interval boundaries inside the
        prompt now; at the prompt's end mark a turn checkpoint, taken lazily (copy before the
        next step overwrites the state, or hand-over if the sequence ends first)."""
        pos = seq.num_computed
        self.stats.tokens_prefilled += max(0, min(pos, seq.num_prompt) - max(pos - computed, 0))
        if pos < seq.num_prompt and pos % self.interval == 0:
            self._snapshot(seq, pos, turn_end=False)
        elif pos == seq.num_prompt and not self.index.contains(seq.token_ids, pos, _salt(seq)):
            seq.pending_checkpoint = True

    def before_step(self, seq) -> None:
        if getattr(seq, "pending_checkpoint", False):
            seq.pending_checkpoint = False
            self._snapshot(seq, seq.num_prompt, turn_end=True)

    def on_finish(self, seq) -> bool:
        """A sequence ending with its state still at the prompt's end hands its slot and pages to
        a checkpoint instead of copying them. True when it did (its memory now belongs to the cache)."""
        if not getattr(seq, "pending_checkpoint", False) or seq.num_computed != seq.num_prompt or seq.kda_slot is None:
            return False
        seq.pending_checkpoint = False
        ck = Checkpoint(seq.num_prompt, turn_end=True)
        self.owners.hand_over(seq, ck, -(-ck.pos // self.page))
        self.index.add(ck, seq.token_ids, _salt(seq))
        self.stats.checkpoints_handed_over += 1
        return True

    # ---- memory -----------------------------------------------------------------------------
    def _snapshot(self, seq, pos: int, turn_end: bool) -> None:
        if self.index.contains(seq.token_ids, pos, _salt(seq)):
            return
        n_full, partial = divmod(pos, self.page)
        if not self.make_room(1, int(partial > 0)):
            self.stats.checkpoints_skipped += 1
            return
        ck = Checkpoint(pos, turn_end)
        self.owners.alloc_slot(ck)
        self.pool.copy_slot(seq.kda_slot, ck.kda_slot)
        for p in seq.pages[:n_full]:
            self.owners.share_page(ck, p)
        if partial:  # the sequence keeps appending to this page: the checkpoint gets its own copy
            self.pool.copy_page(seq.pages[n_full], self.owners.alloc_page(ck))
        self.index.add(ck, seq.token_ids, _salt(seq))
        self.stats.checkpoints_taken += 1

    def make_room(self, slots: int, pages: int, protect: tuple = ()) -> bool:
        """Evict checkpoints, least recently used first and intermediate ones before turn
        boundaries, until the pool can allocate; False if even an empty cache is not enough."""
        victims = None
        while not self.owners.can_allocate(slots=slots, pages=pages):
            if victims is None:
                victims = sorted((c for c in self.index.checkpoints() if c not in protect),
                                 key=lambda c: (c.turn_end, c.last_used))
            if not victims:
                return False
            self.evict(victims.pop(0))
        return True

    def evict(self, ck: Checkpoint) -> None:
        self.index.remove(ck)
        self.owners.release(ck)
        self.stats.checkpoints_evicted += 1

    def clear(self) -> None:
        for ck in self.index.checkpoints():
            self.evict(ck)

    def stats_dict(self) -> dict:
        return self.stats.as_dict(len(self.index))

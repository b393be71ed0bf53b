"""Assignments grouped by expert into padded row blocks, for prefill-sized batches, in two
launches: ``moe_triton.sort_by_expert_sizes``'s layouts (one size: ``sort_by_expert_torch``'s).
The torch form is ~20 launches for one block size and ~50 for four; a prefill step is host-bound
where its kernels are short (kimi-linear-48b, 512 tokens: 33 ms of kernels in a 120 ms eager step,
RESULTS.md fifteenth session), and every launch costs tens of microseconds of host time.

Launch 1, a program per chunk of assignments: a histogram of its experts added into the counts,
its share of the rows filled with padding; the last program to finish (``tickets.last_arrival``)
turns the counts into each size's segment starts and labels every block with its expert. Launch
2: each assignment takes a rank in its expert by an atomic cursor, which places it (the first
whole blocks of the largest size, the rest in the expert's tail block); its last program zeroes
the counts and cursors, which live in the stream's ticket buffer, for the next call. Row order
inside an expert follows the atomics: each row of the grouped GEMM is computed on its own.
Checked against the torch form under the interpreter (tests/test_moe_triton.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_start
from .tickets import last_arrival, tickets

BLOCK_A = 1024  # assignments a program
BLOCK_R = 1024  # rows or blocks a store


@triton.jit
def _clamped_ids(IDS, a, num_assign, num_experts, SPARE: tl.constexpr):
    """The chunk's expert ids, stray ones clamped into range (memory safety, as the one-program
    align kernel); lanes past the end read ``SPARE``."""
    live = a < num_assign
    ids = tl.load(IDS + a, mask=live, other=0)
    return tl.where(live, tl.minimum(tl.maximum(ids, 0), num_experts - 1), SPARE).to(tl.int32)


@triton.jit
def _size_tables(cnt, full, rem, tail, c: tl.constexpr, S: tl.constexpr, IS_BIG: tl.constexpr, STARTS, BE,
                 boff, n_blocks, e, num_experts, E_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """Size ``c`` (rows S): each expert's segment start, and its blocks' expert labels (blocks
    past the last segment: the last expert, as the torch form's clamped search)."""
    n = tl.where((tail == c) & (rem > 0), rem, 0)
    if IS_BIG:
        n += full
    padded = (n + S - 1) // S * S
    starts = tl.cumsum(padded, 0) - padded
    tl.store(STARTS + c * E_P + e, starts)
    used = tl.sum(padded, 0) // S
    for b0 in range(0, n_blocks, BLOCK_R):
        b = b0 + tl.arange(0, BLOCK_R)
        tl.store(BE + boff + b, tl.zeros([BLOCK_R], tl.int64) + (num_experts - 1), mask=(b < n_blocks) & (b >= used))
    own = padded // S
    for j in range(0, tl.max(own, 0)):
        tl.store(BE + boff + starts // S + j, e.to(tl.int64), mask=(j < own) & (e < num_experts))


@triton.jit
def _count_kernel(IDS, COUNTS, TICKETS, ROWS, STARTS, FULL, TAIL, BE, num_assign, num_experts, rows_total,
                  nb0, nb1, nb2, nb3, boff1, boff2, boff3, E_P: tl.constexpr, NUM: tl.constexpr,
                  S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr,
                  BLOCK_A: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    e = tl.arange(0, E_P)
    ids = _clamped_ids(IDS, pid * BLOCK_A + tl.arange(0, BLOCK_A), num_assign, num_experts, E_P - 1)
    tl.atomic_add(COUNTS + e, tl.histogram(ids, E_P), mask=e < num_experts)  # (lanes past the end: bin E_P - 1)
    share = tl.cdiv(rows_total, progs)
    end = tl.minimum(pid * share + share, rows_total)
    for r0 in range(pid * share, end, BLOCK_R):  # every row padding until placed
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(ROWS + r, tl.zeros([BLOCK_R], tl.int64) + num_assign, mask=r < end)
    if last_arrival(TICKETS, 0, progs):
        cnt = tl.load(COUNTS + e, mask=e < num_experts, other=0, cache_modifier=".cg")  # (the others' atomics, at L2)
        BIG: tl.constexpr = S3 if NUM == 4 else S2 if NUM == 3 else S1 if NUM == 2 else S0
        full = cnt // BIG * BIG  # rows in whole blocks of the largest size
        rem = cnt - full
        tail = tl.zeros([E_P], tl.int32) + (NUM - 1)  # the size holding the rest: the smallest that fits
        if NUM > 3:
            tail = tl.where(rem <= S2, 2, tail)
        if NUM > 2:
            tail = tl.where(rem <= S1, 1, tail)
        if NUM > 1:
            tail = tl.where(rem <= S0, 0, tail)
        tl.store(FULL + e, full)
        tl.store(TAIL + e, tail)
        _size_tables(cnt, full, rem, tail, 0, S0, NUM == 1, STARTS, BE, 0, nb0, e, num_experts, E_P, BLOCK_R)
        if NUM > 1:
            _size_tables(cnt, full, rem, tail, 1, S1, NUM == 2, STARTS, BE, boff1, nb1, e, num_experts, E_P, BLOCK_R)
        if NUM > 2:
            _size_tables(cnt, full, rem, tail, 2, S2, NUM == 3, STARTS, BE, boff2, nb2, e, num_experts, E_P, BLOCK_R)
        if NUM > 3:
            _size_tables(cnt, full, rem, tail, 3, S3, True, STARTS, BE, boff3, nb3, e, num_experts, E_P, BLOCK_R)


@triton.jit
def _place_kernel(IDS, COUNTS, CURSOR, TICKETS, ROWS, STARTS, FULL, TAIL, num_assign, num_experts,
                  roff1, roff2, roff3, E_P: tl.constexpr, NUM: tl.constexpr, BLOCK_A: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    pdl_start(USE_PDL)
    pid = tl.program_id(0)
    a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    live = a < num_assign
    ids = _clamped_ids(IDS, a, num_assign, num_experts, 0)
    rank = tl.atomic_add(CURSOR + ids, 1, mask=live)
    full = tl.load(FULL + ids, mask=live, other=0)
    in_tail = rank >= full
    cls = tl.where(in_tail, tl.load(TAIL + ids, mask=live, other=0), NUM - 1)
    pos = tl.load(STARTS + cls * E_P + ids, mask=live, other=0).to(tl.int64) \
        + tl.where(in_tail & (cls < NUM - 1), rank - full, rank)
    off = tl.where(cls == 1, roff1, tl.where(cls == 2, roff2, tl.where(cls == 3, roff3, 0))).to(tl.int64)
    tl.store(ROWS + off + pos, a.to(tl.int64), mask=live)
    if last_arrival(TICKETS, 1, tl.num_programs(0)):  # every rank taken: counts and cursors back to zero
        e = tl.arange(0, E_P)
        tl.store(COUNTS + e, tl.zeros([E_P], tl.int32))
        tl.store(CURSOR + e, tl.zeros([E_P], tl.int32))


def sort_by_expert_kernel(ids: torch.Tensor, num_experts: int, sizes: tuple, totals: tuple) -> list:
    """``sort_by_expert_sizes``'s layouts ([(block_m, rows, block expert)], ``totals`` rows a size,
    the caller's bounds) in two launches, no host sync. Up to four sizes, ascending."""
    if not 1 <= len(sizes) <= 4 or list(sizes) != sorted(set(sizes)):
        raise ValueError(f"one to four ascending row-block sizes, got {sizes}")
    flat = ids.flatten().contiguous()
    num_assign = flat.numel()
    dev = flat.device
    e_p = triton.next_power_of_2(num_experts + 1)
    nb = [t // s for t, s in zip(totals, sizes)]
    roff = [sum(totals[:i]) for i in range(len(sizes))]
    boff = [sum(nb[:i]) for i in range(len(sizes))]
    pad4 = lambda v: list(v) + [0] * (4 - len(v))  # noqa: E731
    rows = torch.empty(sum(totals), dtype=torch.int64, device=dev)
    block_expert = torch.empty(sum(nb), dtype=torch.int64, device=dev)
    starts = torch.empty(len(sizes) * e_p, dtype=torch.int32, device=dev)
    full, tail = (torch.empty(e_p, dtype=torch.int32, device=dev) for _ in range(2))
    tk = tickets(dev, 2 + 2 * e_p)  # [2 tickets | counts | cursors], zero between calls
    counts, cursor = tk[2:2 + e_p], tk[2 + e_p:2 + 2 * e_p]
    progs = max(triton.cdiv(num_assign, BLOCK_A), 1)
    s = pad4(sizes)
    _count_kernel[(progs,)](flat, counts, tk, rows, starts, full, tail, block_expert, num_assign, num_experts,
                            rows.numel(), *pad4(nb), *pad4(boff)[1:], E_P=e_p, NUM=len(sizes), S0=s[0],
                            S1=s[1] or 1, S2=s[2] or 1, S3=s[3] or 1, BLOCK_A=BLOCK_A, BLOCK_R=BLOCK_R,
                            **pdl.launch(dev))
    _place_kernel[(progs,)](flat, counts, cursor, tk, rows, starts, full, tail, num_assign, num_experts,
                            *pad4(roff)[1:], E_P=e_p, NUM=len(sizes), BLOCK_A=BLOCK_A, **pdl.launch(dev))
    return [(size, rows[r:r + t], block_expert[b:b + n]) for size, r, t, b, n in zip(sizes, roff, totals, boff, nb)]

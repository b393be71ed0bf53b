"""Assignments grouped by expert into padded row blocks: the layout every grouped GEMM reads (a
block's rows one expert's, valid rows leading, padding rows holding ``num_assign``).

- Decode (up to ``ALIGN_KERNEL_MAX_ASSIGN`` assignments): one program, one launch
  (``_align_by_expert_kernel``); at one token no sort at all (``one_row_blocks``).
- Prefill: ``sort_by_expert_sizes``: each expert's rows as whole blocks of the largest size, the
  rest in one block of the smallest size that holds it (``moe_triton.GLUON_PREFILL_SIZES``). In
  torch ops (``_sort_torch``, the reference: ~20 launches for one size, ~50 for four) or, where
  ``SORT_KERNEL``, in two launches (``sort_by_expert_kernel``). A prefill step is host-bound where
  its kernels are short (kimi-linear-48b, 512 tokens: 33 ms of kernels in a 120 ms eager step,
  RESULTS.md fifteenth session), and every launch costs tens of microseconds of host time.

The two launches: a program per chunk of assignments adds a histogram of its experts into the
counts and fills its share of the rows with padding; the last program to finish
(``tickets.last_arrival``) turns the counts into each size's segment starts and labels every block
with its expert. Then each assignment takes a rank in its expert from an atomic cursor, which
places it; the last program zeroes the counts and cursors, which live in the stream's ticket
buffer, for the next call (graph-safe). Row order inside an expert follows the atomics: each row
of the grouped GEMM is computed on its own. Checked against the torch form under the interpreter
(tests/test_moe_triton.py) and on the GPU (bench/gpu_check_kernels.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .autotune import interpreted
from .pdl import pdl_start
from .tickets import last_arrival, tickets

BLOCK_A = 1024  # assignments a program (two-launch sort)
BLOCK_R = 1024  # rows or blocks a store


@triton.jit
def _clamped_ids(IDS, a, num_assign, num_experts, SPARE: tl.constexpr):
    """The chunk's expert ids, stray ones clamped into range (memory safety, as the one-program
    align kernel); lanes past the end read ``SPARE``."""
    live = a < num_assign
    ids = tl.load(IDS + a, mask=live, other=0)
    return tl.where(live, tl.minimum(tl.maximum(ids, 0), num_experts - 1), SPARE).to(tl.int32)


@triton.jit
def _segments(n, S: tl.constexpr, STARTS, BE, boff, n_blocks, e, num_experts, BLOCK_R: tl.constexpr):
    """Each expert's ``n`` rows padded to blocks of S: its segment start stored at ``STARTS`` (and
    returned), its blocks labelled with it, blocks past the last segment with the last expert (as
    the torch form's clamped search). Each expert labels its own blocks: one pass at decode, where
    an expert holds one or two (a [blocks x experts] comparison took 9 reductions at batch 64)."""
    padded = (n + S - 1) // S * S
    starts = tl.cumsum(padded, 0) - padded
    tl.store(STARTS + e, starts)
    used = tl.sum(padded, 0) // S
    for b0 in range(0, n_blocks, BLOCK_R):
        b = b0 + tl.arange(0, BLOCK_R)
        tl.store(BE + boff + b, tl.zeros([BLOCK_R], tl.int64) + (num_experts - 1), mask=(b < n_blocks) & (b >= used))
    own = padded // S
    for j in range(0, tl.max(own, 0)):
        tl.store(BE + boff + starts // S + j, e.to(tl.int64), mask=(j < own) & (e < num_experts))


@triton.jit
def _align_by_expert_kernel(IDS, ROWS, BLOCK_EXPERT, CURSOR, num_assign, num_experts, total_rows,
                            E_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
                            BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program: counting sort of the assignments into per-expert segments padded to BLOCK_M
    rows (``sort_by_expert_torch``'s layout). Row order inside a segment follows the atomics, which
    changes nothing: every row of the grouped GEMM is computed on its own."""
    pdl_start(USE_PDL)
    e = tl.arange(0, E_P)
    counts = tl.zeros([E_P], tl.int32)
    for a0 in range(0, num_assign, BLOCK_A):  # (lanes past the end: a spare bin >= E)
        counts += tl.histogram(_clamped_ids(IDS, a0 + tl.arange(0, BLOCK_A), num_assign, num_experts, E_P - 1), E_P)
    counts = tl.where(e < num_experts, counts, 0)
    for r0 in range(0, total_rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        tl.store(ROWS + r, tl.zeros([BLOCK_R], tl.int64) + num_assign, mask=r < total_rows)
    # each expert's cursor starts at its segment's first row
    _segments(counts, BLOCK_M, CURSOR, BLOCK_EXPERT, 0, total_rows // BLOCK_M, e, num_experts, BLOCK_R)
    tl.debug_barrier()  # the cursors and the padding are written before any row lands
    for a0 in range(0, num_assign, BLOCK_A):
        a = a0 + tl.arange(0, BLOCK_A)
        live = a < num_assign
        ids = _clamped_ids(IDS, a, num_assign, num_experts, 0)  # (stray ids where they were counted)
        pos = tl.atomic_add(CURSOR + ids, 1, mask=live)
        tl.store(ROWS + pos, a.to(tl.int64), mask=live)


def _padded_rows(num_assign: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded length (every expert's last block partly empty): sizes the buffers
    without a host sync, and keeps a decode step's shapes static for CUDA graphs. A non-empty
    expert's segment has at most as many blocks as rows, so the segments end within num_assign
    blocks: at batch 1 on Kimi-Linear that is 8 blocks to pad and label, not 248 (the one-program
    sort took 13 us a layer there, RESULTS.md sixth session)."""
    total = num_assign + num_experts * (block_m - 1)
    return min((total + block_m - 1) // block_m, num_assign) * block_m


# Up to this many assignments (512 tokens x top-8: every decode step) one program sorts them; past
# it one program would serialise too much work: the torch ops (or ``SORT_KERNEL``'s two launches).
ALIGN_KERNEL_MAX_ASSIGN = 4096


def sort_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Assignments (token * top_k + slot) grouped by expert and padded to ``block_m`` rows per
    expert, on the device. Returns (rows [padded], expert of each row block). Padding rows hold
    ``num_assign`` and are skipped by the GEMM. Small batches take one kernel launch."""
    flat = ids.flatten().contiguous()
    num_assign = flat.numel()
    if num_assign > ALIGN_KERNEL_MAX_ASSIGN:
        return sort_by_expert_sizes(ids, num_experts, (block_m,))[0][1:]
    total = _padded_rows(num_assign, num_experts, block_m)
    rows = torch.empty(total, dtype=torch.int64, device=ids.device)
    block_expert = torch.empty(total // block_m, dtype=torch.int64, device=ids.device)
    e_p = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(e_p, dtype=torch.int32, device=ids.device)
    _align_by_expert_kernel[(1,)](flat, rows, block_expert, cursor, num_assign, num_experts, total,
                                  E_P=e_p, BLOCK_M=block_m, BLOCK_A=512, BLOCK_R=1024, **pdl.launch(rows.device))
    return rows, block_expert


_ONE_ROW_BLOCKS: dict = {}


def one_row_blocks(num_assign: int, block_m: int, device: torch.device) -> torch.Tensor:
    """Rows for a layout of one assignment per row block (block i: row i, then padding), with the
    routing ids themselves as the blocks' experts: a batch-1 decode step needs no sort (the align
    kernel was 26 launches, ~0.09 ms, of a kimi-linear batch-1 step; RESULTS.md eighth session).
    A constant, built once per shape and kept (CUDA graphs hold its address); the ids must name
    real experts (our routers' always do; ``sort_by_expert`` also clamps stray ones)."""
    key = (device, num_assign, block_m)
    rows = _ONE_ROW_BLOCKS.get(key)
    if rows is None:
        rows = torch.full((num_assign, block_m), num_assign, dtype=torch.int64)
        rows[:, 0] = torch.arange(num_assign)
        rows = _ONE_ROW_BLOCKS[key] = rows.flatten().to(device)
    return rows


def sort_by_expert_torch(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sort_by_expert`` in torch ops (the reference of its layout; rows in stable order)."""
    return _sort_torch(ids, num_experts, (block_m,))[0][1:]


# Past ``ALIGN_KERNEL_MAX_ASSIGN`` (prefill), sort in two launches (``sort_by_expert_kernel``) instead
# of the torch ops (~20 launches for one size, ~50 for four): kimi-linear-48b's eager prefill step,
# 1 x 8,192 tokens, 2,675 -> 1,037 kernels, 202 -> 186 ms (RESULTS.md, sixteenth session).
SORT_KERNEL = True


def _sort_totals(num_assign: int, num_experts: int, sizes: tuple) -> list[int]:
    """Rows a size: the largest's bound as ``_padded_rows``; a tail size holds one block an expert."""
    return [_padded_rows(num_assign, num_experts, bm) if i == len(sizes) - 1 else min(num_experts, num_assign) * bm
            for i, bm in enumerate(sizes)]


def sort_by_expert_sizes(ids: torch.Tensor, num_experts: int, sizes: tuple) -> list:
    """Each expert's assignments as row blocks of the largest of ``sizes`` (ascending) while that
    many remain, the rest as one block of the smallest size that holds it, so a prefill expert's
    ~150 rows take one block of 128 and one of 32 (2 weight upcasts, 160 rows computed) instead of
    three of 64 (3 upcasts, 192 rows). Returns [(block_m, rows, block expert)], one layout (each
    ``sort_by_expert_torch``'s form) a size, on the device, no host sync: buffers are sized by
    bounds (a tail size holds at most one block an expert), each launch's blocks of padding only
    exit at once. Every assignment is in exactly one layout. Two launches
    (``sort_by_expert_kernel``) where ``SORT_KERNEL``, else torch ops (``_sort_torch``, the
    reference)."""
    if SORT_KERNEL and len(sizes) <= 4 and (ids.is_cuda or interpreted()):
        return sort_by_expert_kernel(ids, num_experts, tuple(sizes),
                                     tuple(_sort_totals(ids.numel(), num_experts, sizes)))
    return _sort_torch(ids, num_experts, sizes)


def layout_mismatches(ids: torch.Tensor, ref: list, got: list) -> list[str]:
    """What differs between two ``sort_by_expert_sizes`` results, blind to the order of rows inside
    an expert (the two-launch sort's follows its atomics, so a row may sit in another of its
    expert's blocks, or in its other size's layout): the same block owners and padding a block,
    valid rows leading, every valid row its block's expert's, every assignment exactly once."""
    flat = ids.flatten()
    n = flat.numel()
    problems, seen = [], []
    if [r[0] for r in ref] != [g[0] for g in got]:
        return [f"sizes {[r[0] for r in ref]} vs {[g[0] for g in got]}"]
    for (bm, rows, owners), (_, grows, gowners) in zip(ref, got):
        if rows.shape != grows.shape or not torch.equal(owners, gowners):
            problems.append(f"size {bm}: block owners or row count differ")
            continue
        blocks, gblocks = rows.view(-1, bm), grows.view(-1, bm)
        valid = gblocks < n
        if not torch.equal(valid.sum(1), (blocks < n).sum(1)):
            problems.append(f"size {bm}: valid rows a block differ")
        if not torch.equal(valid, torch.arange(bm, device=valid.device) < valid.sum(1, keepdim=True)):
            problems.append(f"size {bm}: padding before valid rows")
        if not torch.equal(flat[gblocks.clamp_max(n - 1)][valid], gowners[:, None].expand_as(gblocks)[valid]):
            problems.append(f"size {bm}: a row in another expert's block")
        seen.append(gblocks[valid])
    if not problems and not torch.equal(torch.cat(seen).sort().values, torch.arange(n, device=flat.device)):
        problems.append("assignments missing or repeated")
    return problems


def _sort_torch(ids: torch.Tensor, num_experts: int, sizes: tuple) -> list:
    """``sort_by_expert_sizes`` in torch ops (rows in stable order)."""
    flat = ids.flatten()
    num_assign = flat.numel()
    dev = ids.device
    # scatter_add, not bincount: CUDA bincount reads the maximum back to size its output (a host
    # sync that also breaks CUDA-graph capture).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    big = sizes[-1]
    full = counts // big * big  # rows in whole blocks of the largest size
    tail = sum((counts - full > s).long() for s in sizes[:-1])  # the size index holding the rest (no host tensor)
    order = torch.argsort(flat, stable=True)
    sorted_e = flat[order]
    rank = torch.arange(num_assign, device=dev) - (torch.cumsum(counts, 0) - counts)[sorted_e]
    in_tail = rank >= full[sorted_e]
    layouts = []
    totals = _sort_totals(num_assign, num_experts, sizes)
    for i, bm in enumerate(sizes):
        is_big = i == len(sizes) - 1
        has_tail = (tail == i) & (counts > full)
        n = torch.where(has_tail, counts - full, 0) + (full if is_big else 0)  # this layout's rows an expert
        member = (in_tail & has_tail[sorted_e]) | (~in_tail if is_big else False)
        at = rank - (0 if is_big else full[sorted_e])  # rank inside this layout's segment
        padded = (n + bm - 1) // bm * bm
        starts = torch.cumsum(padded, 0) - padded
        total = totals[i]
        rows = torch.full((total + 1,), num_assign, dtype=torch.int64, device=dev)  # (+1: non-members' slot)
        rows[torch.where(member, starts[sorted_e] + at, total)] = order
        block_expert = torch.searchsorted(torch.cumsum(padded, 0), torch.arange(0, total, bm, device=dev),
                                          right=True).clamp_max(num_experts - 1)
        layouts.append((bm, rows[:total], block_expert))
    return layouts


@triton.jit
def _size_tables(full, rem, tail, c: tl.constexpr, S: tl.constexpr, IS_BIG: tl.constexpr, STARTS, BE,
                 boff, n_blocks, e, num_experts, E_P: tl.constexpr, BLOCK_R: tl.constexpr):
    """Size ``c`` (rows S): each expert's rows of that size (its tail, and for the largest its
    whole blocks too), as ``_segments``."""
    n = tl.where((tail == c) & (rem > 0), rem, 0)
    if IS_BIG:
        n += full
    _segments(n, S, STARTS + c * E_P, BE, boff, n_blocks, e, num_experts, BLOCK_R)


@triton.jit
def _expert_count_kernel(IDS, COUNTS, TICKETS, ROWS, STARTS, FULL, TAIL, BE, num_assign, num_experts, rows_total,
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
        _size_tables(full, rem, tail, 0, S0, NUM == 1, STARTS, BE, 0, nb0, e, num_experts, E_P, BLOCK_R)
        if NUM > 1:
            _size_tables(full, rem, tail, 1, S1, NUM == 2, STARTS, BE, boff1, nb1, e, num_experts, E_P, BLOCK_R)
        if NUM > 2:
            _size_tables(full, rem, tail, 2, S2, NUM == 3, STARTS, BE, boff2, nb2, e, num_experts, E_P, BLOCK_R)
        if NUM > 3:
            _size_tables(full, rem, tail, 3, S3, True, STARTS, BE, boff3, nb3, e, num_experts, E_P, BLOCK_R)


@triton.jit
def _expert_place_kernel(IDS, COUNTS, CURSOR, TICKETS, ROWS, STARTS, FULL, TAIL, num_assign, num_experts,
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
    _expert_count_kernel[(progs,)](flat, counts, tk, rows, starts, full, tail, block_expert, num_assign, num_experts,
                                   rows.numel(), *pad4(nb), *pad4(boff)[1:], E_P=e_p, NUM=len(sizes), S0=s[0],
                                   S1=s[1] or 1, S2=s[2] or 1, S3=s[3] or 1, BLOCK_A=BLOCK_A, BLOCK_R=BLOCK_R,
                                   **pdl.launch(dev))
    _expert_place_kernel[(progs,)](flat, counts, cursor, tk, rows, starts, full, tail, num_assign, num_experts,
                                   *pad4(roff)[1:], E_P=e_p, NUM=len(sizes), BLOCK_A=BLOCK_A, **pdl.launch(dev))
    return [(size, rows[r:r + t], block_expert[b:b + n]) for size, r, t, b, n in zip(sizes, roff, totals, boff, nb)]

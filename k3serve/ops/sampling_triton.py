"""Top-k / top-p / min-p sampling without sorting the vocabulary: one launch a step.

The torch sampler (engine/sampler.py) sorts every sampled row's logits to find what top-k and top-p
keep: on the H200 a kimi-linear decode step with temperature 0.7 and top-p 0.95 took 0.29 / 0.80 /
1.66 ms more than greedy at batch 1 / 16 / 64 (10-12 % of the step, RESULTS.md thirty-second
session). What the filters keep is a threshold on the logits, so it is found here by radix
selection: the logits' fp32 bits as order-preserving 32-bit keys, four bits a pass from the top, a
pass a 16-bin histogram of what is still a candidate (its count for top-k, its probability mass
for top-p), the next digit the largest whose bins from the top reach the target. Then the draw is
the same exponential race as the torch sampler's, argmax over kept tokens of p_i / q_i, on the
caller's noise q (seeded rows keep their own generators).

A row is split between up to ``PROGRAMS`` programs that meet at grid barriers (ops/tickets.py)
between the phases (row maximum, 8 count passes if any row has top-k, 8 mass passes if any has
top-p < 1, the draw); the histograms are summed by fixed groups of logits, and every program reads
all of a phase's and takes the same digit, so a row's result does not depend on how many programs
the batch leaves it. Under Triton's CPU interpreter (one program at a time, so no barrier can
open) each phase is a launch of its own. With more rows than SMs a row is one program (its
barriers wait for nothing). The maximum's phase also keeps each block's maximum: a later pass
skips (reads and sums nothing of) a block whose maximum is below every key it could still count,
and the draw one below the threshold. A model's logits are peaked (a few tokens far above the
rest), so from the 3rd pass on most blocks are skipped; skipping adds nothing but exact zeros, so
the sums, the tokens and the batch-independence are those of reading every block.

Semantics against the sort (the reference: engine/sampler.filter_logits): top-k keeps
the k largest and top-p the shortest prefix of the top-k's renormalised distribution whose mass
reaches top_p; here tokens tied with the last kept one are kept too (the sort keeps an arbitrary
subset of them), and the masses are summed in another order (a boundary token can differ when the
prefix's mass is within fp32 rounding of top_p)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .autotune import interpreted, sm_count
from .tickets import barrier

# Elements a program handles at once (2 a thread of 8 warps) and how many blocks its loads run ahead
# (Triton's pipelining through shared memory). 512 keeps a program (not skipping) at 128 registers, two an SM: at
# 256 rows (one program a row) 2.0 ms against 2.5 with 1,024 (one an SM, 187 registers; 16 warps at
# 1,024 were no faster), 3-7 % slower at 16-64 rows (bench/kernels_sampling.py --bare, RESULTS.md
# thirty-third session). One size for every batch: a row's sums, and so its token, do not change
# with the batch.
BLOCK = 512
STAGES = 3  # (4 spilled with every filter on)
WARPS = 8
# Skipping blocks by their maximum (see above), where some filter has passes and the batch leaves
# each SM one program anyway (rows <= SMs): it takes 175 registers (the skip's branch merges the
# histogram's), one program an SM, and past the SMs' count the 128-register form's two programs an
# SM win (256 rows, top-p: 2.0 against 3.1 ms on broad logits). At 1-64 rows it makes top-p 0.95
# 15-33 % faster on peaked logits, on broad ones (a dummy model's) 8 % faster at 1 row and 5-8 %
# slower at 16-64, and top-k 50 + top-p 17-30 % faster on both (RESULTS.md thirty-fourth session).
# Candidate lists (a group's possible survivors written out at its 2nd-3rd pass and read instead of
# its logits after) were slower everywhere, peaked logits too (1.5-2.2x the time: ~240 registers, a
# scan a block), and were removed.
SKIP = True
GROUP_SIZE = 4096  # logits a histogram sum runs over in registers (a row's programs take whole groups;
# 2,048 was 7-17 % slower, RESULTS.md thirty-fourth session)
PASSES = tl.constexpr(8)  # 4-bit digits of 32-bit keys


@triton.jit
def _keys(x):
    """Order-preserving uint32 keys of fp32 values: larger value, larger key (negative values'
    bits flipped, positive ones' sign bit set)."""
    b = x.to(tl.uint32, bitcast=True)
    return tl.where((b >> 31) != 0, ~b, b | 0x80000000)


@triton.jit
def _load(X, offs, valid, temp):
    """The row's logits at offs (where valid) over its temperature (as the torch sampler divides them)."""
    x = tl.div_rn(tl.load(X + offs, mask=valid, other=float("-inf")), temp)
    return tl.where(x == x, x, float("-inf"))  # (NaN never kept)


@triton.jit
def _block(X, BMAX, s, hi, temp, floor, BLOCK: tl.constexpr, SKIP: tl.constexpr):
    """The block at s: (x, its offsets, valid, live). [1, BLOCK] tensors (every tensor 2-D,
    broadcast against the 16 digits: from 1-D ones Triton converted each block's layout through
    shared memory, a barrier a block). With SKIP a block whose maximum (BMAX) has a key below
    ``floor`` is not live: nothing loaded, nothing valid."""
    offs = s + tl.arange(0, BLOCK)[None, :]
    if SKIP:
        live = _keys(tl.load(BMAX + s // BLOCK)) >= floor
        valid = offs < tl.where(live, hi, 0)
    else:
        live = True
        valid = offs < hi
    return _load(X, offs, valid, temp), offs, valid, live


@triton.jit
def _histogram(X, OUT, BMAX, lo, hi, temp, M, tau_k, prefix, SHIFT: tl.constexpr, MASS: tl.constexpr,
               BLOCK: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr, SKIP: tl.constexpr):
    """16 bins of each group of GROUP blocks of this program's (OUT + 16 x the group's index) of
    candidates (keys >= tau_k whose bits above SHIFT + 4 are prefix's) by their digit at SHIFT:
    counts, or masses exp(x - M). Each thread sums its elements' bins over the group, then one
    reduction (one a block and bin, each through shared memory, made the passes latency-bound:
    RESULTS.md thirty-second session); by group, not by program, so that a row's sums do not
    depend on how many programs share it (the batch's size), nor do its tokens. A candidate's key
    is at least prefix (its lower bits 0) and tau_k: blocks below both are skipped."""
    acc = tl.zeros([16, BLOCK], tl.float32)
    floor = tl.maximum(prefix, tau_k)
    for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
        x, offs, valid, live = _block(X, BMAX, s, hi, temp, floor, BLOCK, SKIP)
        if live:
            acc += _digit_bins(x, _keys(x), valid, M, tau_k, prefix, SHIFT, MASS)
        if ((s // BLOCK) % GROUP == GROUP - 1) | (s + BLOCK >= hi):  # the group's last block
            tl.store(OUT + (s // (BLOCK * GROUP)) * 16 + tl.arange(0, 16), tl.sum(acc, 1))
            acc = tl.zeros([16, BLOCK], tl.float32)


@triton.jit
def _digit_bins(x, key, valid, M, tau_k, prefix, SHIFT: tl.constexpr, MASS: tl.constexpr):
    """[16, BLOCK]: a block's candidates' weights in their digit's row."""
    cand = valid & (key >= tau_k)
    if SHIFT < 28:  # (the first pass: every key)
        cand = cand & ((key >> (SHIFT + 4)) == (prefix >> (SHIFT + 4)))
    w = tl.where(cand, tl.exp(x - M) if MASS else 1.0, 0.0)
    d = ((key >> SHIFT) & 15).to(tl.int32)
    return tl.where(d == tl.arange(0, 16)[:, None], w, 0.0)


@triton.jit
def _bins(PART, NB, NB_P: tl.constexpr):
    """The row's 16 bins: its NB groups' summed in a fixed order."""
    blocks = tl.arange(0, NB_P)
    return tl.sum(tl.load(PART + blocks[:, None] * 16 + tl.arange(0, 16)[None, :], mask=(blocks < NB)[:, None],
                          other=0.0), 0)


@triton.jit
def _select(PART, NB, NB_P: tl.constexpr, prefix, above, target, SHIFT: tl.constexpr):
    """The phase's digit from all blocks' bins: the largest whose bins from the top, with what
    lies above them, reach ``target``. Returns (prefix, above) with it."""
    digits = tl.arange(0, 16)
    tot = _bins(PART, NB, NB_P)
    suffix = tl.sum(tot, 0) - tl.cumsum(tot, 0) + tot  # mass (count) of digits >= d
    d = tl.max(tl.where(above + suffix >= target, digits, 0), 0)
    above += tl.sum(tl.where(digits > d, tot, 0.0), 0)
    return prefix | (d.to(tl.uint32) << SHIFT), above


@triton.jit
def _radix_select(X, PART, COUNTS, BMAX, r, P, lo, hi, temp, M, tau_k, target, NB, NB_P: tl.constexpr,
                  PH0: tl.constexpr, PHASE: tl.constexpr, MASS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                  STAGES: tl.constexpr, SKIP: tl.constexpr):
    """The largest key t whose candidates (keys >= tau_k) at or above it reach ``target``: their
    count, or with MASS their mass, ``target`` then a share of the candidates' total. PASSES phases
    from PH0, each a histogram (this launch's, where PHASE says so), a barrier (PHASE 0), a digit."""
    prefix = tl.full((), 0, tl.uint32)
    above = 0.0
    for j in tl.static_range(PASSES):
        ph = PH0 + j
        SHIFT = 28 - 4 * j
        if PHASE == 0 or PHASE == ph + 1:
            _histogram(X, PART + ph * NB_P * 16, BMAX, lo, hi, temp, M, tau_k, prefix, SHIFT, MASS, BLOCK, GROUP,
                       STAGES, SKIP)
        if PHASE == 0:
            barrier(COUNTS, r, P)
        if MASS and j == 0:  # the candidates' mass: every one of them is in the first pass
            target = target * tl.sum(_bins(PART + ph * NB_P * 16, NB, NB_P), 0)
        prefix, above = _select(PART + ph * NB_P * 16, NB, NB_P, prefix, above, target, SHIFT)
    return prefix


@triton.jit
def _sample_kernel(X, ROWS, Q, PARAMS, PART, COUNTS, OUT, TAU, BMAX, V, S, stride_x, stride_q, P,
                   NB_P: tl.constexpr, HAS_K: tl.constexpr, HAS_P: tl.constexpr, HAS_MIN: tl.constexpr,
                   PHASE: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, STAGES: tl.constexpr,
                   SKIP: tl.constexpr):
    """Program (part of a row, row). PHASE 0: every phase, grid barriers between them; k > 0
    (interpreted): the state from the partials of phases before k - 1 (stored by earlier launches),
    then phase k - 1's own work (the last phase: the draw's reduction)."""
    c = tl.program_id(0)
    r = tl.program_id(1)
    X += tl.load(ROWS + r) * stride_x
    Q += r.to(tl.int64) * stride_q
    temp = tl.load(PARAMS + r)  # PARAMS [4, S]: temperature, top-k, top-p, min-p
    per = tl.cdiv(tl.cdiv(V, P), BLOCK * GROUP) * BLOCK * GROUP
    lo = c * per
    hi = tl.minimum(lo + per, V)
    N_PH: tl.constexpr = 2 + PASSES * (HAS_K + HAS_P)  # max, passes, draw
    NB = tl.cdiv(V, BLOCK * GROUP)  # (NB_P >= NB >= P: a phase's slots, by group or by program)
    PART += r.to(tl.int64) * (N_PH * NB_P * 16)
    BMAX += r * tl.cdiv(V, BLOCK)
    mine = PART + c * 16
    progs = tl.arange(0, NB_P)
    # -- phase 0: the row maximum (and each block's, for the passes to skip by)
    if PHASE == 0 or PHASE == 1:
        m = tl.full([1, BLOCK], float("-inf"), tl.float32)  # (a lane's; reduced once, after the loop)
        for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            offs = s + tl.arange(0, BLOCK)[None, :]
            x = _load(X, offs, offs < hi, temp)
            m = tl.maximum(m, x)
            if SKIP:
                tl.store(BMAX + s // BLOCK, tl.max(x))
        tl.store(mine, tl.max(m))
    if PHASE == 0:
        barrier(COUNTS, r, P)
    M = tl.max(tl.load(PART + progs * 16, mask=progs < P, other=float("-inf")), 0)
    # -- top-k: the k-th largest key (count passes); k 0 (off) asks for more than the row holds
    tau_k = tl.full((), 0, tl.uint32)
    if HAS_K:
        k = tl.load(PARAMS + S + r)
        tau_k = _radix_select(X, PART, COUNTS, BMAX, r, P, lo, hi, temp, M, tau_k, tl.where(k > 0, k, V + 1.0),
                              NB, NB_P, 1, PHASE, False, BLOCK, GROUP, STAGES, SKIP)
    # -- top-p over the top-k: the shortest prefix whose mass reaches top_p of theirs (mass passes)
    tau = tau_k
    if HAS_P:
        top_p = tl.load(PARAMS + 2 * S + r)
        tau_p = _radix_select(X, PART, COUNTS, BMAX, r, P, lo, hi, temp, M, tau_k, top_p, NB, NB_P,
                              1 + PASSES * HAS_K, PHASE, True, BLOCK, GROUP, STAGES, SKIP)
        tau = tl.where((top_p < 1.0) & (tau_p > tau), tau_p, tau)
    # -- the draw: argmax over kept tokens of (x - M) - log q, the first index on ties
    LAST: tl.constexpr = N_PH - 1
    if PHASE == 0 or PHASE == LAST + 1:
        min_p = tl.load(PARAMS + 3 * S + r) if HAS_MIN else 0.0
        best = tl.full([1, BLOCK], float("-inf"), tl.float32)  # a lane's best and its first index
        best_i = tl.full([1, BLOCK], 0, tl.int32) + V
        for s in tl.range(lo, hi, BLOCK, num_stages=STAGES):
            x, offs, valid, live = _block(X, BMAX, s, hi, temp, tau, BLOCK, SKIP)
            q = tl.load(Q + offs, mask=valid, other=1.0)
            if live:
                keep = valid & (_keys(x) >= tau)
                if HAS_MIN:
                    keep = keep & (tl.exp(x - M) >= min_p)
                score = tl.where(keep, (x - M) - tl.log(tl.maximum(q, 1.1754943508222875e-38)), float("-inf"))
                better = score > best  # (a lane meets its indices in increasing order)
                best_i = tl.where(better, offs, best_i)
                best = tl.where(better, score, best)
        top_score = tl.max(best)
        tl.store(mine + LAST * NB_P * 16, top_score)
        first = tl.min(tl.where(best == top_score, best_i, V))
        tl.store(mine + LAST * NB_P * 16 + 1, first.to(tl.float32))  # (exact: V < 2^24)
    if PHASE == 0:
        barrier(COUNTS, r, P)
    if (PHASE == 0 or PHASE == LAST + 2) and c == 0:
        row = PART + LAST * NB_P * 16 + progs * 16
        b = tl.load(row, mask=progs < P, other=float("-inf"))
        i = tl.load(row + 1, mask=progs < P, other=3.0e38)
        top = tl.max(b, 0)
        tl.store(OUT + r, tl.min(tl.where(b == top, i, 3.0e38), 0).to(tl.int64))
        tl.store(TAU + r, tau.to(tl.int64))  # (kept: keys >= tau, and min-p; for the checks)


# Programs a row at most; a row gets fewer where the batch would not fit one program an SM (the
# barriers need every program of a row resident at once).
PROGRAMS = 64


def keys(x: torch.Tensor) -> torch.Tensor:
    """``_keys`` in torch (int64 [0, 2^32): larger fp32 value, larger key)."""
    b = x.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(b >= 0x80000000, 0xFFFFFFFF - b, b + 0x80000000)


def programs_per_row(rows: int, vocab: int, sms: int, group_size: int = GROUP_SIZE) -> int:
    return max(1, min(PROGRAMS, triton.cdiv(vocab, group_size), sms // max(rows, 1)))


def sample_filtered(logits: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, params: torch.Tensor,
                    has_k: bool, has_p: bool, has_min: bool, tau: torch.Tensor | None = None,
                    programs: int | None = None, stages: int | None = None, block: int | None = None,
                    warps: int | None = None, skip: bool | None = None,
                    group_size: int | None = None) -> torch.Tensor:
    """Token ids [S] drawn for rows ``rows`` [S] (int64) of fp32 logits [B, V]: each row over its
    temperature, then its top-k (0 off), top-p (1 off) and min-p (0 off), params [4, S] fp32 =
    (temperature, top-k, top-p, min-p); the token is the argmax over the kept tokens of
    softmax_i / q_i, q [S, V] Exp(1) noise. ``has_*``: whether any row uses the filter
    (host-known, so no pass runs for nothing). ``tau`` [S] int64, if given, receives each row's
    key threshold (``keys``): the kept tokens are those with keys >= it (and the min-p bound).
    ``programs``: a row's programs (None: as many as the batch leaves room for; the result does
    not depend on it). ``stages``, ``block``, ``warps``, ``skip``, ``group_size``: ``STAGES``,
    ``BLOCK``, ``WARPS``, ``SKIP`` (where it pays), ``GROUP_SIZE`` (None) or others (A/B timing;
    a multiple of the block; the result does not depend on ``skip``)."""
    S, V = q.shape
    if (logits.dtype != torch.float32 or logits.shape[1] != V or logits.stride(1) != 1 or q.stride(1) != 1
            or params.shape != (4, S) or not params.is_contiguous() or params.dtype != torch.float32):
        raise ValueError("sample_filtered takes fp32 logits [B, V] and noise [S, V] with contiguous rows, "
                         "params [4, S]")
    out = torch.empty(S, dtype=torch.int64, device=q.device)
    tau = torch.empty_like(out) if tau is None else tau
    if S == 0:
        return out
    split = interpreted()
    sms = 2 * S if split else sm_count(q.device)
    gs, block = group_size or GROUP_SIZE, block or BLOCK
    per = triton.cdiv(triton.cdiv(V, programs or programs_per_row(S, V, sms, gs)), gs) * gs
    P = triton.cdiv(V, per)  # (the kernel's split: no program without elements)
    NB_P = max(2, triton.next_power_of_2(triton.cdiv(V, gs)))
    phases = 2 + PASSES.value * (int(has_k) + int(has_p))
    part = torch.empty(S, phases, NB_P, 16, dtype=torch.float32, device=q.device)
    counts = torch.zeros(S, dtype=torch.int64, device=q.device)
    if skip is None:
        skip = SKIP and (has_k or has_p) and S <= sms
    block_max = torch.empty(S, triton.cdiv(V, block), dtype=torch.float32, device=q.device)
    args = (logits, rows, q, params, part, counts, out, tau, block_max, V, S, logits.stride(0), q.stride(0), P)
    consts = dict(NB_P=NB_P, HAS_K=has_k, HAS_P=has_p, HAS_MIN=has_min, BLOCK=block, GROUP=gs // block,
                  STAGES=stages or STAGES, SKIP=skip, num_warps=warps or WARPS)
    for phase in range(1, phases + 2) if split else (0,):
        _sample_kernel[(P, S)](*args, PHASE=phase, **consts)
    return out

"""Does a persistent kernel beat one launch per layer at batch 1? A chain of dependent GEMVs (each
stage's output is the next one's input, as a decode step's projections are) timed three ways:

- ``gemv``: the served split-K GEMV (ops/gemv_triton.py), one PDL launch a stage;
- ``pdl``: the kernel below launched once a stage, each program loading its first weight tile
  *before* its PDL wait (weights never depend on the previous stage), so that load overlaps the
  previous launch's tail (the tenth session's L2 hints before the wait gained nothing; this puts
  the bytes in registers);
- ``persistent``: one launch for the whole chain, one program an SM, a grid-wide barrier (a
  counter in global memory) between stages, each program loading its first tile of the next stage
  before it waits;
- ``tma`` (Gluon): persistent too, over weights pre-tiled so that each [rows, k] chunk is
  contiguous; each program streams a balanced run of every stage's chunks through a TMA ring in
  shared memory (an mbarrier a slot), issued ring-depth chunks ahead and never held by the grid
  barrier, so the next stage's weights keep arriving while a program waits for the previous
  stage. Activations fp32, split row blocks summed with fire-and-forget adds; a stage's input is
  copied into shared memory once; optionally (``mma``) each chunk summed by wgmma. It replaced
  the twentieth session's cp.async ring (22 us a 19 MB stage on the H200, 20 % of copy: that
  loop waited on an L2 load of its activation slice and re-read the stage's sizes for every 8 KB
  chunk). ``trace_summary`` splits a stage's time from the kernel's own global-timer stamps.

A kimi-linear-48b batch-1 step is ~350 kernels over 2.5 ms against a 1.45 ms byte floor
(RESULTS.md nineteenth session): GEMVs run at ~61 % of copy, and ~0.55 ms goes to launches of
2-6 us. If the persistent chain streams its weights much nearer the copy ceiling than the
per-stage launches, a persistent decode layer is the way to the issue's 550 tok/s; if not, not.
Checked against a float64 chain on fresh random inputs (here on the GPU; tests/test_gemv_chain.py
on CPU under the interpreter, one program). Not used by the model. Answer on the H200 for the
Triton forms (RESULTS.md twentieth session): no; the served GEMV a launch a stage 8.6 us (52 % of
copy) at 19 MB, the best persistent 11.7 us, the best pre-wait PDL form 11.5 us. For the TMA form
(twenty-first session): yes, but not by enough: 6.5 us (68 %) at 19 MB and 3.6 us at 4.7 MB
against the served 8.4 and 4.3-4.7; of a 19 MB stage's 6.1 us, 1.1 go to seeing the barrier,
0.5 to the input, 3.9 to the chunks although they wait only 0.35 for their copies (the loop, not
DRAM, limits it: ~0.45 us a 16 KB chunk even with the weights in shared memory and wgmma).

    python3 -m bench.gemv_chain [--stages 40] [--dims 2304,4096] [--dims 2304,1024] [--modes gemv,tma]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl  # (module level: Gluon reads annotations from here)

from k3serve.ops import pdl
from k3serve.ops.pdl import pdl_start


@triton.jit
def _rows_dot(w, x, rows, rmask, K, k_from, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum over k in [k_from, K) of w[rows, k] x[k], fp32 [BLOCK_N]."""
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(k_from, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        wt = tl.load(w + rows.to(tl.int64)[:, None] * K + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        xk = tl.load(x + k, mask=kmask, other=0.0, cache_modifier=".cg")
        acc += tl.sum(wt.to(tl.float32) * xk.to(tl.float32)[None, :], 1)
    return acc


MAX_SPINS = tl.constexpr(1 << 16)  # ~30-60 ms of L2 round trips: far above a stage, far below a hang


@triton.jit
def _chain_kernel(ACT, W, DIMS, WOFF, AOFF, COUNTER, first_stage, num_stages, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, BLOCK_KF: tl.constexpr, PERSISTENT: tl.constexpr,
                  USE_PDL: tl.constexpr = False):
    """Stages first_stage .. first_stage + num_stages - 1: act[s + 1] = W[s] act[s] (bf16, fp32
    sums). Program p takes rows [N p / P, N (p + 1) / P) of each stage in chunks of BLOCK_N, its
    first chunk's first BLOCK_KF columns loaded before it waits for the stage's input."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    for s in range(first_stage, first_stage + num_stages):
        K = tl.load(DIMS + s)
        N = tl.load(DIMS + s + 1)
        w = W + tl.load(WOFF + s)
        x = ACT + tl.load(AOFF + s)
        y = ACT + tl.load(AOFF + s + 1)
        r_start = (N * pid) // P
        r_end = (N * (pid + 1)) // P
        rows = r_start + tl.arange(0, BLOCK_N)
        rmask = rows < r_end
        kf = tl.arange(0, BLOCK_KF)
        w_first = tl.load(w + rows.to(tl.int64)[:, None] * K + kf[None, :], mask=rmask[:, None] & (kf < K)[None, :],
                          other=0.0)
        if PERSISTENT:
            if s > first_stage:  # every program has finished stage s - 1
                target = (s - first_stage) * P
                seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
                spins = 0
                while (seen < target) & (spins < MAX_SPINS):  # (capped: programs not all resident
                    seen = tl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")  # end wrong, not hung)
                    spins += 1
                tl.debug_barrier()
        else:
            pdl_start(USE_PDL)
        xf = tl.load(x + kf, mask=kf < K, other=0.0, cache_modifier=".cg")
        acc = tl.sum(w_first.to(tl.float32) * xf.to(tl.float32)[None, :], 1)
        acc += _rows_dot(w, x, rows, rmask, K, BLOCK_KF, BLOCK_N, BLOCK_K)
        tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rmask)
        for r0 in range(r_start + BLOCK_N, r_end, BLOCK_N):
            rows = r0 + tl.arange(0, BLOCK_N)
            rmask = rows < r_end
            acc = _rows_dot(w, x, rows, rmask, K, 0, BLOCK_N, BLOCK_K)
            tl.store(y + rows, acc.to(y.dtype.element_ty), mask=rmask)
        if PERSISTENT:
            tl.debug_barrier()  # all of this program's stores before its release
            ticket = tl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
            if ticket == num_stages * P - 1:  # the chain's last arrival: zero for the next launch
                tl.store(COUNTER, 0)


@functools.cache
def tma_kernel():
    """The Gluon TMA form (``tma``), built on first use (the interpreted CPU tests import this
    module but never build it)."""
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma

    from k3serve.ops.gluon_compat import async_load, cta_barrier, tma_load

    @gluon.jit
    def _entry(tab, s, col: gl.constexpr, WARPS: gl.constexpr):
        """Column col of the chain table's row s, from its copy in shared memory (each thread reads
        the row's 4 words and keeps one: no global load, so no L1 miss after the barrier's fence)."""
        row_l: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
        row = tab.index(s).load(row_l)
        return gl.sum(gl.where(gl.arange(0, 4, layout=row_l) == col, row, 0), 0)

    @gluon.jit
    def _span(tab, s, pid, P, WARPS: gl.constexpr):
        """Program pid's chunks of stage s: [first, end) in the stage's own numbering, and the
        stage's first chunk in the whole tiled buffer."""
        base = _entry(tab, s, 0, WARPS)
        count = _entry(tab, s + 1, 0, WARPS) - base
        return (count * pid) // P, (count * (pid + 1)) // P, base

    @gluon.jit
    def _issue_rows(tab, s, num_stages, pid, P, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """The issue cursor at stage s: this program's first and end rows of the tiled matrix."""
        j0, j1, base = _span(tab, gl.minimum(s, num_stages - 1), pid, P, WARPS)
        return (base + j0) * BLOCK_N, (base + j1) * BLOCK_N

    @gluon.jit
    def _issue(desc, bars, ring, tab, slot, live, s, row, row_end, num_stages, pid, P, BLOCK_N: gl.constexpr,
               WARPS: gl.constexpr):
        """The chunk at tiled row ``row`` into ring slot ``slot`` if ``live``; the cursor moved on."""
        mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=live)
        tma_load(desc, [row, 0], bars.index(slot), ring.index(slot), pred=live)
        row += BLOCK_N
        if row == row_end:
            s += 1
            row, row_end = _issue_rows(tab, s, num_stages, pid, P, BLOCK_N, WARPS)
        return s, row, row_end

    @gluon.jit
    def _now():
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _red_add_rows(ptrs, vals, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """Fire-and-forget fp32 adds (``red``), one a row. (Triton 3.6 lowers ``atomic_add`` to an
        ``atom`` that waits for the old value, a round trip to L2 a flush.) Moved to a layout whose
        first BLOCK_N threads hold the rows once each; the copies further up add nothing."""
        rows_l: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.lt.u32 p, t, $3; "
            "@p red.relaxed.gpu.global.add.f32 [$1], $2; mov.u32 $0, 0; }", "=r,l,f,r",
            [gl.convert_layout(ptrs.to(gl.int64), rows_l), gl.convert_layout(vals, rows_l),
             gl.full([BLOCK_N], BLOCK_N, gl.int32, rows_l)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _arrive(COUNTER):
        """The grid barrier's arrival, fire-and-forget: thread 0 fences (the CTA barrier before it
        made every thread's sums its own, cumulatively) and adds 1 without waiting for a reply."""
        gl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p fence.acq_rel.gpu; @p red.relaxed.gpu.global.add.u32 [$1], 1; mov.u32 $0, 0; }", "=r,l",
            [COUNTER.to(gl.int64)], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _tma_chain_kernel(desc, ACT, TAB, COUNTER, TIMES, num_stages, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, MAX_KB: gl.constexpr, MAX_ROWS: gl.constexpr, RING: gl.constexpr,
                          WARPS: gl.constexpr,
                          MMA: gl.constexpr = False, TRACE: gl.constexpr = False):
        """The whole chain in one persistent launch over pre-tiled weights (each [BLOCK_N, BLOCK_K]
        chunk contiguous, a stage's chunks row block by row block): program p takes a balanced
        contiguous run of each stage's chunks and streams them with TMA through a RING-slot ring
        (one mbarrier a slot), each copy issued RING chunks ahead by one thread and never held by
        the grid barrier. fp32 activations: row blocks split between programs are summed with
        atomics into outputs the host zeroed; a stage's input is copied once into shared memory
        (cp.async, every row in flight at once). The chain's table TAB [stages + 1, 4] (int32: first
        chunk, K, activation offset, 0) is copied into shared memory at the start: the barrier's
        acquire invalidates L1, and a global read of the table after it would wait for L2 (ncu,
        twenty-first session; polling with volatile loads and one fence after them instead was
        slower to see the barrier open: 1.38 vs 1.15 us). MMA: each chunk summed on the tensor cores
        (wgmma, the chunk from shared memory as A [BLOCK_N = 64, BLOCK_K], the input as B [BLOCK_K,
        8] with seven zero columns, one warpgroup), not with a multiply-add a weight a thread.
        TRACE: the global timer (ns) at each stage's start, barrier passed, input staged, first chunk landed and arrival, and the time its chunks
        waited for their copies, into TIMES [stages, programs, 6]."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        # a row of the input spread over the whole CTA, no lane copying what another does
        x_layout: gl.constexpr = gl.BlockedLayout([max(1, BLOCK_K // (32 * WARPS))], [32], [WARPS], [0])
        if MMA:
            acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, 8, 16])
            ACC_W: gl.constexpr = 8
            xb = gl.allocate_shared_memory(gl.bfloat16, [MAX_KB, 8, BLOCK_K],
                                           gl.NVMMASharedLayout.get_default_for([8, BLOCK_K], gl.bfloat16))
        else:
            acc_l: gl.constexpr = layout
            ACC_W: gl.constexpr = BLOCK_K
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        ring = gl.allocate_shared_memory(desc.dtype, [RING, BLOCK_N, BLOCK_K], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        x_smem = gl.allocate_shared_memory(gl.float32, [MAX_KB, BLOCK_K],  # (a row a K block)
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        tab = gl.allocate_shared_memory(gl.int32, [MAX_ROWS, 4],  # (a row a stage)
                                        gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        tab_cols = gl.arange(0, 4, layout=gl.BlockedLayout([4], [32], [WARPS], [0]))
        for r in range(0, num_stages + 1):
            async_load(tab.index(r), TAB + r * 4 + tab_cols)
        async_copy.commit_group()
        for i in gl.static_range(RING):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        async_copy.wait_group(0)
        cta_barrier()
        total = 0
        for s in range(0, num_stages):
            j0, j1, _ = _span(tab, s, pid, P, WARPS)
            total += j1 - j0
        s_i = 0  # the issue cursor: stage, tiled row, this program's end row of the stage
        row_i, row_end_i = _issue_rows(tab, 0, num_stages, pid, P, BLOCK_N, WARPS)
        for g in gl.static_range(RING):
            s_i, row_i, row_end_i = _issue(desc, bars, ring, tab, g, g < total, s_i, row_i, row_end_i, num_stages,
                                           pid, P, BLOCK_N, WARPS)
        rows_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_l))
        cols_acc = gl.arange(0, ACC_W, layout=gl.SliceLayout(0, acc_l))
        ks = gl.arange(0, BLOCK_K, layout=x_layout)
        acc = gl.zeros([BLOCK_N, ACC_W], gl.float32, acc_l)
        s_c = 0  # the compute cursor: stage, its chunk, this program's end chunk, the stage's sizes
        j_c, j_end_c, _ = _span(tab, 0, pid, P, WARPS)
        first = True
        K = _entry(tab, 0, 1, WARPS)
        n_kb = K // BLOCK_K
        kb = j_c % n_kb  # (the chunk's K block and row block, carried: no division a chunk)
        rb = j_c // n_kb
        y = ACT + _entry(tab, 1, 2, WARPS)
        if TRACE:
            waited = _now() * 0
        else:
            waited = 0
        for g in range(0, total):
            if first:  # this program's first chunk of the stage: its input, once
                if TRACE:
                    gl.store(TIMES + (s_c * P + pid) * 6, _now())
                if s_c > 0:  # every program's sums of the previous stage are in
                    seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
                    spins = 0
                    while (seen < s_c * P) & (spins < MAX_SPINS):  # (capped, as the Triton form)
                        seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
                        spins += 1
                    cta_barrier()
                if TRACE:
                    gl.store(TIMES + (s_c * P + pid) * 6 + 1, _now())
                x_in = ACT + gl.multiple_of(_entry(tab, s_c, 2, WARPS), 16)  # (sizes are multiples of BLOCK_K)
                for i in gl.static_range(MAX_KB):
                    async_load(x_smem.index(i), x_in + i * BLOCK_K + ks, mask=(ks * 0 + i * BLOCK_K) < K,
                               cache_modifier=".cg")  # (a row's mask uniform: 16-byte copies)
                async_copy.commit_group()
                async_copy.wait_group(0)
                cta_barrier()
                if MMA:  # the B tiles: the input in row 0, bf16, zeros below
                    r8 = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
                    for kx in range(0, n_kb):
                        xr = x_smem.index(kx).load(gl.SliceLayout(0, layout))
                        xb.index(kx).store(gl.where(r8[:, None] == 0, xr[None, :], 0.0).to(gl.bfloat16))
                    fence_async_shared()
                    cta_barrier()
                if TRACE:
                    gl.store(TIMES + (s_c * P + pid) * 6 + 2, _now())
            slot = g % RING
            if TRACE:
                before = _now()
            mbarrier.wait(bars.index(slot), (g // RING) & 1)
            if TRACE:
                waited += _now() - before
                if first:
                    gl.store(TIMES + (s_c * P + pid) * 6 + 3, _now())
            if MMA:
                acc = warpgroup_mma(ring.index(slot), xb.index(kb).permute([1, 0]), acc)
            else:
                w = ring.index(slot).load(layout)
                xk = x_smem.index(kb).load(gl.SliceLayout(0, layout))
                acc += w.to(gl.float32) * xk[None, :]
            last = j_c == j_end_c - 1
            if (kb == n_kb - 1) | last:  # a row block's share done: add it in
                if MMA:
                    part = gl.sum(gl.where(cols_acc[None, :] == 0, acc, 0.0), 1)
                else:
                    part = gl.sum(acc, 1)
                _red_add_rows(y + rb * BLOCK_N + rows_in, part, BLOCK_N, WARPS)
                acc = gl.zeros([BLOCK_N, ACC_W], gl.float32, acc_l)
            cta_barrier()  # every thread done with the slot (and, at a stage's end, with its sums)
            s_i, row_i, row_end_i = _issue(desc, bars, ring, tab, slot, g + RING < total, s_i, row_i, row_end_i,
                                           num_stages, pid, P, BLOCK_N, WARPS)
            first = last
            if last:  # this program's part of the stage done: arrive, go to the next stage
                if TRACE:
                    gl.store(TIMES + (s_c * P + pid) * 6 + 4, _now())
                    gl.store(TIMES + (s_c * P + pid) * 6 + 5, waited)
                    waited = waited * 0
                _arrive(COUNTER)  # (no reply awaited: the host zeroes the counter)
                s_c += 1
                s_next = gl.minimum(s_c, num_stages - 1)
                j_c, j_end_c, _ = _span(tab, s_next, pid, P, WARPS)
                K = _entry(tab, s_next, 1, WARPS)
                n_kb = K // BLOCK_K
                kb = j_c % n_kb
                rb = j_c // n_kb
                y = ACT + _entry(tab, s_next + 1, 2, WARPS)
            else:
                j_c += 1
                kb += 1
                if kb == n_kb:
                    kb = 0
                    rb += 1
        for i in gl.static_range(RING):
            mbarrier.invalidate(bars.index(i))

    return _tma_chain_kernel


def tile_chunks(w: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    """A weight [N, K] cut into [block_n, block_k] chunks, each contiguous, K block fastest within
    a row block: [N K / block_k, block_k], chunk c = rows c block_n .. (one TMA box a chunk)."""
    n, k = w.shape
    if n % block_n or k % block_k:
        raise ValueError(f"a weight [{n}, {k}] does not cut into [{block_n}, {block_k}] chunks")
    return w.view(n // block_n, block_n, k // block_k, block_k).transpose(1, 2).reshape(-1, block_k)


class Chain:
    """Weights [N_s, K_s] (bf16, scaled to keep activations O(1)) and one activation buffer."""

    def __init__(self, dims: list[int], gen: torch.Generator, dtype=torch.bfloat16):
        device = gen.device
        self.dims = dims
        sizes = [k * n for k, n in zip(dims, dims[1:])]
        self.flat_w = torch.empty(sum(sizes), dtype=dtype, device=device)
        self.weights = [w.view(n, k) for w, k, n in zip(torch.split(self.flat_w, sizes), dims, dims[1:])]
        for w in self.weights:
            w.copy_(torch.randn(w.shape, generator=gen, device=device) / w.shape[1] ** 0.5)
        self.act = torch.zeros(sum(dims), dtype=dtype, device=device)
        offs = lambda n: torch.tensor([sum(n[:i]) for i in range(len(n))], dtype=torch.int64, device=device)  # noqa: E731
        self.woff = offs(sizes)
        self.aoff = offs(dims)
        self.dims_dev = torch.tensor(dims, dtype=torch.int32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.acts = list(torch.split(self.act, dims))
        self.act32 = torch.zeros(sum(dims), dtype=torch.float32, device=device)  # (the tma form's)
        self._tiled = {}

    def tiled(self, block_n: int, block_k: int):
        """The tma form's weights: every stage cut into [block_n, block_k] chunks, each contiguous,
        row block by row block, all stages in one [rows, block_k] matrix (one TMA descriptor); the
        kernel's table (int32 [stages + 1, 4]: a stage's first chunk, K, activation offset, 0); and the
        fewest chunks of a stage."""
        if (block_n, block_k) in self._tiled:
            return self._tiled[block_n, block_k]
        parts = [tile_chunks(w, block_n, block_k) for w in self.weights]
        counts = [w.numel() // (block_n * block_k) for w in self.weights]
        table = torch.zeros(len(self.dims), 4, dtype=torch.int32)
        table[:, 0] = torch.tensor([sum(counts[:i]) for i in range(len(counts) + 1)])
        table[:, 1] = torch.tensor(self.dims)
        table[:, 2] = self.aoff.cpu()
        self._tiled = {(block_n, block_k): (torch.cat(parts), table.to(self.act.device), min(counts))}  # (one at
        # a time: memory)
        return self._tiled[block_n, block_k]

    @property
    def weight_bytes(self) -> int:
        return self.flat_w.numel() * self.flat_w.element_size()

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """float64 chain, each stage's output rounded to the activations' dtype as the kernels store it."""
        y = x
        for w in self.weights:
            y = (w.double() @ y.double()).to(self.act.dtype)
        return y

    def run(self, mode: str, programs: int, block_n: int = 8, block_k: int = 512, block_kf: int = 1024,
            warps: int = 4, ring: int = 8, mma: bool = False, times: torch.Tensor | None = None) -> torch.Tensor:
        """The chain on ``self.acts[0]``; returns the last activation (a view). ``times``: the tma
        form's trace, int64 [stages, programs, 6] (see the kernel)."""
        args = (self.act, self.flat_w, self.dims_dev, self.woff, self.aoff, self.counter)
        meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_KF=block_kf, num_warps=warps)
        stages = len(self.weights)
        if mode == "persistent":
            _chain_kernel[(programs,)](*args, 0, stages, PERSISTENT=True, **meta)
        elif mode == "pdl":
            for s in range(stages):
                _chain_kernel[(programs,)](*args, s, 1, PERSISTENT=False, **meta, **pdl.launch(self.act.device))
        elif mode == "tma":  # (block_kf unused; the ring's depth in chunks is ``ring``): fp32 activations
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

            tiled, table, fewest = self.tiled(block_n, block_k)
            if fewest < programs:
                raise ValueError(f"the tma form needs a chunk a program a stage: {fewest} < {programs}")
            desc = TensorDescriptor.from_tensor(tiled, [block_n, block_k],
                                                gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16))
            self.act32[self.dims[0]:].zero_()  # (the stages' sums are atomics)
            self.counter.zero_()  # (the arrivals are fire-and-forget: nobody is there to reset it)
            self.act32[:self.dims[0]].copy_(self.acts[0])
            max_kb = triton.next_power_of_2(max(self.dims[:-1]) // block_k)
            tma_kernel()[(programs,)](desc, self.act32, table, self.counter,
                                      self.counter if times is None else times, stages, BLOCK_N=block_n,
                                      BLOCK_K=block_k, MAX_KB=max_kb, MAX_ROWS=triton.next_power_of_2(stages + 1),
                                      RING=ring, WARPS=warps, MMA=mma,
                                      TRACE=times is not None, num_warps=warps)
            return self.act32[-self.dims[-1]:]
        elif mode == "gemv":
            from k3serve.ops.gemv_triton import gemv

            for s, w in enumerate(self.weights):
                gemv(self.acts[s][None], w, out=self.acts[s + 1][None])
        else:
            raise ValueError(f"mode {mode!r}: persistent, pdl, tma or gemv")
        return self.acts[-1]


def trace_summary(chain: Chain, programs: int, tile: dict) -> None:
    """Where a tma stage's time goes, from one traced run (global timer, ns; medians over stages
    1 .. S-2 of each program's phases, then over programs, and the spread of the arrivals)."""
    stages = len(chain.weights)
    times = torch.zeros(stages, programs, 6, dtype=torch.int64, device="cuda")
    chain.run("tma", programs, **tile)  # (warm)
    chain.run("tma", programs, **tile, times=times)
    t = (times - times[0, :, 0].min()).double().cpu() / 1e3  # us from the chain's start
    mid = slice(1, stages - 1)
    waited = times[mid, :, 5].double().cpu() / 1e3
    wait, stage_in = t[mid, :, 1] - t[mid, :, 0], t[mid, :, 2] - t[mid, :, 1]
    landed, work = t[mid, :, 3] - t[mid, :, 2], t[mid, :, 4] - t[mid, :, 2]
    last_arrival = t[:, :, 4].max(1).values  # a stage done everywhere
    passed = t[1:, :, 1]  # the next stage's barrier seen, each program
    med = lambda v: v.median().item()  # noqa: E731
    print(f"\ntrace, tile {tuple(tile.values())}: us a stage, medians over stages and programs (max over programs)")
    print("| period (last arrival to last arrival) | barrier wait | seen after the last arrival | input staged | "
          "first chunk there after | chunks (input staged .. arrival) | of which waiting for copies | arrivals' spread |")
    print("|---|---|---|---|---|---|---|---|")
    spread = (t[mid, :, 4].max(1).values - t[mid, :, 4].min(1).values)
    print(f"| {med(last_arrival[1:] - last_arrival[:-1]):.2f} | {med(wait):.2f} ({med(wait.max(1).values):.2f}) | "
          f"{med(passed - last_arrival[:-1, None]):.2f} ({med((passed - last_arrival[:-1, None]).max(1).values):.2f}) "
          f"| {med(stage_in):.2f} ({med(stage_in.max(1).values):.2f}) | {med(landed):.2f} ({med(landed.max(1).values):.2f})"
          f" | {med(work):.2f} ({med(work.max(1).values):.2f}) | {med(waited):.2f} ({med(waited.max(1).values):.2f})"
          f" | {med(spread):.2f} |\n")


def main() -> None:
    from .ceilings import copy_bench_setup
    from .timing import gpu_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=40)
    ap.add_argument("--dims", action="append", default=None, help="activation sizes the chain alternates through")
    ap.add_argument("--modes", default="gemv,pdl,persistent,tma", help="which forms to time")
    args = ap.parse_args()
    copy, programs, gen = copy_bench_setup()
    print("| dims | stage MB | variant | programs | tile (rows, k, first k or ring slots, warps) | max rel err | us a stage | % of copy |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.dims or ["2304,4096", "2304,1024"]:
        cycle = [int(d) for d in spec.split(",")]
        dims = [cycle[i % len(cycle)] for i in range(args.stages + 1)]
        chain = Chain(dims, gen)
        x = torch.randn(dims[0], generator=gen, device="cuda").to(chain.act.dtype)
        ref = chain.reference(x)
        floor_us = chain.weight_bytes / (copy * 1e12) * 1e6 / args.stages  # (weight bytes against copy's, as kernels_dense)
        # (bytes in flight a program: rows x k x 2 a tile, times the loop's pipelining; ~48 KB an SM
        # covers ~1.5 us of its share of the copy ceiling)
        tiles = ((8, 512, 1024, 4), (16, 512, 1024, 8), (8, 1024, 2048, 8), (32, 256, 1024, 8), (4, 1024, 2048, 4))
        variants = [("gemv", 1, {})] + [(m, mult, dict(block_n=bn, block_k=bk, block_kf=bkf, warps=w))
                                        for m in ("pdl", "persistent") for mult in (1, 2)
                                        for bn, bk, bkf, w in tiles]
        # the tma form: one program an SM (a ring of RING chunks, 64-128 KB of shared memory)
        # (mma: wgmma a chunk, one warpgroup, 64-row chunks)
        variants += [("tma", 1, dict(block_n=bn, block_k=bk, ring=r, warps=w, mma=mma))
                     for bn, bk, r, w, mma in ((32, 256, 4, 4, False), (32, 256, 6, 4, False), (64, 256, 3, 4, False),
                                               (64, 256, 3, 4, True), (64, 256, 4, 4, True), (64, 128, 6, 4, True),
                                               (64, 128, 8, 4, True))]
        # more warps to hide the chunk loop's latencies (ncu, twenty-first session: one 4-warp CTA an
        # SM issued an instruction every 5.4 cycles), and two CTAs an SM
        variants += [("tma", mult, dict(block_n=bn, block_k=bk, ring=r, warps=w, mma=False))
                     for mult, bn, bk, r, w in ((1, 32, 256, 4, 8), (1, 64, 256, 4, 8), (1, 32, 256, 6, 8),
                                                (2, 32, 256, 3, 4), (2, 32, 256, 4, 4), (2, 32, 256, 3, 8),
                                                (2, 16, 256, 4, 4))]
        best_tma, best_us = None, float("inf")
        for mode, mult, tile in [v for v in variants if v[0] in args.modes.split(",")]:
            n = programs * mult  # (the persistent form needs all co-resident: 1-2 small programs an SM)
            chain.acts[0].copy_(x)
            try:
                out = chain.run(mode, n, **tile).clone()
                err = ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
                if err > 0.1:  # wrong (a persistent grid whose programs were not all resident; the bf16
                    # roundings alone drift ~1e-3..1e-2 over 40 stages, as the gemv row shows): not timed
                    print(f"| {spec} | | {mode} | {n} | {tuple(tile.values())} | {err:.1e}: wrong, not timed | | |")
                    continue
                us = gpu_ms(lambda: chain.run(mode, n, **tile), cold=False, calls=2) * 1e3 / args.stages
            except Exception as exc:  # a tile that does not compile or fit: say so, go on
                print(f"| {spec} | | {mode} | {n} | {tuple(tile.values())} | failed: {repr(exc)[:80]} | | |")
                continue
            mb = chain.weight_bytes / args.stages / 1e6
            if mode == "tma" and us < best_us:
                best_tma, best_n, best_us = tile, n, us
            print(f"| {spec} | {mb:.1f} | {mode} | {n} | {tuple(tile.values()) or 'tuned'} | {err:.1e} | {us:.2f} | "
                  f"{100 * floor_us / us:.0f} % |", flush=True)
        if best_tma is not None:
            trace_summary(chain, best_n, best_tma)
        chain = None  # (freed before the next dims' chain is built)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

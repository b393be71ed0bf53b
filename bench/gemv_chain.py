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
- ``ring`` (Gluon): persistent too, but each program streams its rows' weight chunks of every
  stage through a cp.async ring in shared memory, issued ring-depth chunks ahead and never held
  by the grid barrier, so the next stage's weights keep arriving while a program waits for the
  previous stage (a stage's share an SM is ~143 KB at 19 MB: a 64-128 KB ring holds most of it).
  The twentieth session's question: with the weights streaming across the barrier, does a
  persistent chain beat one launch a stage? Compiled for sm_90 on CPU; not yet run on a GPU.

A kimi-linear-48b batch-1 step is ~350 kernels over 2.5 ms against a 1.45 ms byte floor
(RESULTS.md nineteenth session): GEMVs run at ~61 % of copy, and ~0.55 ms goes to launches of
2-6 us. If the persistent chain streams its weights much nearer the copy ceiling than the
per-stage launches, a persistent decode layer is the way to the issue's 550 tok/s; if not, not.
Checked against a float64 chain on fresh random inputs (here on the GPU; tests/test_gemv_chain.py
on CPU under the interpreter, one program). Not used by the model. Answer on the H200 for the
Triton forms (RESULTS.md twentieth session): no; the served GEMV a launch a stage 8.6 us (52 % of
copy) at 19 MB, the best persistent 11.7 us, the best pre-wait PDL form 11.5 us. The ring form is
the next run (``bash bench/gpu_session.sh chain``).

    python3 -m bench.gemv_chain [--stages 40] [--dims 2304,4096] [--dims 2304,1024]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
import triton.language as tl

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
def ring_kernel():
    """The Gluon ring form (``ring``), built on first use (the interpreted CPU tests import this
    module but never build it)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy

    from k3serve.ops.gluon_compat import async_load, cta_barrier

    @gluon.jit
    def _stage_rows(DIMS, s, pid, P, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """Stage s for program pid: (K, its first row, its row end, its row blocks, K blocks)."""
        K = gl.load(DIMS + s)
        N = gl.load(DIMS + s + 1)
        r_start = (N * pid) // P
        r_end = (N * (pid + 1)) // P
        return K, r_start, r_end, gl.cdiv(r_end - r_start, BLOCK_N), gl.cdiv(K, BLOCK_K)

    @gluon.jit
    def _next(s, rb, kb, n_rb, n_kb):
        """The chunk after (stage, row block, K block)."""
        kb += 1
        rb_done = kb == n_kb
        kb = gl.where(rb_done, 0, kb)
        rb = gl.where(rb_done, rb + 1, rb)
        stage_done = rb == n_rb
        rb = gl.where(stage_done, 0, rb)
        return gl.where(stage_done, s + 1, s), rb, kb

    @gluon.jit
    def _issue(W, DIMS, WOFF, ring, slot, s, rb, kb, end_stage, pid, P, BLOCK_N: gl.constexpr,
               BLOCK_K: gl.constexpr, layout: gl.constexpr):
        """Copy chunk (s, rb, kb) of this program's weight rows into ring slot ``slot`` (past the
        last stage a harmless copy inside the last one, never read: uniform wait counts)."""
        s_safe = gl.minimum(s, end_stage - 1)
        K, r_start, r_end, n_rb, n_kb = _stage_rows(DIMS, s_safe, pid, P, BLOCK_N, BLOCK_K)
        K8 = K // 8  # (dims are multiples of 8, run() checks: written as 8 x K8 so that every Triton
        # version sees 16-byte aligned rows and copies 16 bytes at a time)
        rows = r_start + rb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        cols = gl.max_contiguous(gl.multiple_of(kb * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout)),
                                                BLOCK_K), BLOCK_K)
        ptrs = W + (gl.load(WOFF + s_safe) // 8) * 8 + (rows.to(gl.int64)[:, None] * K8) * 8 + cols[None, :]
        mask = (rows < r_end)[:, None] & (cols < K8 * 8)[None, :]
        async_load(ring.index(slot), ptrs, mask=mask)
        async_copy.commit_group()
        return _next(s, rb, kb, n_rb, n_kb)

    @gluon.jit
    def _ring_chain_kernel(ACT, W, DIMS, WOFF, AOFF, COUNTER, num_stages, BLOCK_N: gl.constexpr,
                           BLOCK_K: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr):
        """The whole chain in one persistent launch: each program streams its rows' weight chunks
        of every stage, in order, through a RING-slot cp.async ring in shared memory; a chunk's copy
        is issued RING - 1 chunks ahead and never waits on the grid barrier (weights do not depend
        on activations), so DRAM keeps streaming the next stage's weights while a program waits
        for the previous stage's last rows. Only the activation reads wait."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        smem_l: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[1, 0])
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        ring = gl.allocate_shared_memory(W.dtype.element_ty, [RING, BLOCK_N, BLOCK_K], smem_l)
        total = 0
        for s in range(0, num_stages):
            _, _, _, n_rb, n_kb = _stage_rows(DIMS, s, pid, P, BLOCK_N, BLOCK_K)
            total += n_rb * n_kb
        s_i = 0  # the issue cursor: (stage, row block, K block)
        rb_i = 0
        kb_i = 0
        for g in gl.static_range(RING - 1):
            s_i, rb_i, kb_i = _issue(W, DIMS, WOFF, ring, g, s_i, rb_i, kb_i, num_stages, pid, P, BLOCK_N, BLOCK_K,
                                     layout)
        s_c = 0  # the compute cursor
        rb_c = 0
        kb_c = 0
        acc = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, layout))
        for g in range(0, total):
            async_copy.wait_group(RING - 2)  # chunk g landed (this thread's copies)
            cta_barrier()  # (everyone's; and every thread is done with chunk g - 1's slot)
            s_i, rb_i, kb_i = _issue(W, DIMS, WOFF, ring, (g + RING - 1) % RING, s_i, rb_i, kb_i, num_stages,
                                     pid, P, BLOCK_N, BLOCK_K, layout)
            K, r_start, r_end, n_rb, n_kb = _stage_rows(DIMS, s_c, pid, P, BLOCK_N, BLOCK_K)
            if (rb_c == 0) & (kb_c == 0) & (s_c > 0):  # a stage's first chunk: wait for the previous stage
                seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
                spins = 0
                while (seen < s_c * P) & (spins < MAX_SPINS):  # (capped, as the Triton form)
                    seen = gl.atomic_add(COUNTER, 0, sem="acquire", scope="gpu")
                    spins += 1
                cta_barrier()
            cols = gl.max_contiguous(gl.multiple_of(kb_c * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout)),
                                                    BLOCK_K), BLOCK_K)
            x = gl.load(ACT + (gl.load(AOFF + s_c) // 8) * 8 + cols, mask=cols < (K // 8) * 8, other=0.0, cache_modifier=".cg")
            w = ring.index(g % RING).load(layout)
            acc += gl.sum(w.to(gl.float32) * x.to(gl.float32)[None, :], 1)
            if kb_c == n_kb - 1:  # a row block done
                rows = r_start + rb_c * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
                y = ACT + gl.load(AOFF + s_c + 1)
                gl.store(y + rows, acc.to(ACT.dtype.element_ty), mask=rows < r_end)
                acc = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, layout))
                if rb_c == n_rb - 1:  # this program's rows of the stage done: arrive
                    cta_barrier()
                    ticket = gl.atomic_add(COUNTER, 1, sem="acq_rel", scope="gpu")
                    if ticket == num_stages * P - 1:  # the chain's last arrival: zero for the next launch
                        gl.store(COUNTER, 0)
            s_c, rb_c, kb_c = _next(s_c, rb_c, kb_c, n_rb, n_kb)
        async_copy.wait_group(0)

    return _ring_chain_kernel


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
            warps: int = 4, ring: int = 8) -> torch.Tensor:
        """The chain on ``self.acts[0]``; returns the last activation (a view)."""
        args = (self.act, self.flat_w, self.dims_dev, self.woff, self.aoff, self.counter)
        meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_KF=block_kf, num_warps=warps)
        stages = len(self.weights)
        if mode == "persistent":
            _chain_kernel[(programs,)](*args, 0, stages, PERSISTENT=True, **meta)
        elif mode == "pdl":
            for s in range(stages):
                _chain_kernel[(programs,)](*args, s, 1, PERSISTENT=False, **meta, **pdl.launch(self.act.device))
        elif mode == "ring":  # (block_kf unused; the ring's depth in chunks is ``ring``)
            if min(self.dims[1:]) < programs or any(d % 8 for d in self.dims):
                raise ValueError("the ring form needs dims that are multiples of 8 and a row a program a stage")
            ring_kernel()[(programs,)](*args, stages, BLOCK_N=block_n, BLOCK_K=block_k, RING=ring,
                                       WARPS=warps, num_warps=warps)
        elif mode == "gemv":
            from k3serve.ops.gemv_triton import gemv

            for s, w in enumerate(self.weights):
                gemv(self.acts[s][None], w, out=self.acts[s + 1][None])
        else:
            raise ValueError(f"mode {mode!r}: persistent, pdl, ring or gemv")
        return self.acts[-1]


def main() -> None:
    from .ceilings import copy_tbs
    from .timing import gpu_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=40)
    ap.add_argument("--dims", action="append", default=None, help="activation sizes the chain alternates through")
    args = ap.parse_args()
    copy = copy_tbs()
    programs = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator("cuda").manual_seed(0)
    print(f"copy {copy:.2f} TB/s, {programs} SMs\n")
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
        # the ring form: one program an SM (its ring of RING chunks is 64-128 KB of shared memory)
        variants += [("ring", 1, dict(block_n=bn, block_k=bk, ring=r, warps=w))
                     for bn, bk, r, w in ((8, 512, 8, 4), (8, 512, 16, 4), (4, 1024, 16, 4), (16, 256, 12, 8),
                                          (8, 512, 16, 8))]
        for mode, mult, tile in variants:
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
            print(f"| {spec} | {mb:.1f} | {mode} | {n} | {tuple(tile.values()) or 'tuned'} | {err:.1e} | {us:.2f} | "
                  f"{100 * floor_us / us:.0f} % |", flush=True)
        chain = None  # (freed before the next dims' chain is built)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

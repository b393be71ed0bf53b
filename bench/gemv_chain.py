"""Does a persistent kernel beat one launch per layer at batch 1? A chain of dependent GEMVs (each
stage's output is the next one's input, as a decode step's projections are) timed three ways:

- ``gemv``: the served split-K GEMV (ops/gemv_triton.py), one PDL launch a stage;
- ``pdl``: the kernel below launched once a stage, each program loading its first weight tile
  *before* its PDL wait (weights never depend on the previous stage), so that load overlaps the
  previous launch's tail (the tenth session's L2 hints before the wait gained nothing; this puts
  the bytes in registers);
- ``persistent``: one launch for the whole chain, one program an SM, a grid-wide barrier (a
  counter in global memory) between stages, each program loading its first tile of the next stage
  before it waits.

A kimi-linear-48b batch-1 step is ~350 kernels over 2.5 ms against a 1.45 ms byte floor
(RESULTS.md nineteenth session): GEMVs run at ~61 % of copy, and ~0.55 ms goes to launches of
2-6 us. If the persistent chain streams its weights much nearer the copy ceiling than the
per-stage launches, a persistent decode layer is the way to the issue's 550 tok/s; if not, not.
Checked against a float64 chain on fresh random inputs (here on the GPU; tests/test_gemv_chain.py
on CPU under the interpreter, one program). Not used by the model. Answer on the H200 (RESULTS.md
twentieth session): no; the served GEMV a launch a stage 8.6 us (52 % of copy) at 19 MB, the best
persistent 11.7 us, the best pre-wait PDL form 11.5 us.

    python3 -m bench.gemv_chain [--stages 40] [--dims 2304,4096] [--dims 2304,1024]
"""

from __future__ import annotations

import argparse

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
            warps: int = 4) -> torch.Tensor:
        """The chain on ``self.acts[0]``; returns the last activation (a view)."""
        args = (self.act, self.flat_w, self.dims_dev, self.woff, self.aoff, self.counter)
        meta = dict(BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_KF=block_kf, num_warps=warps)
        stages = len(self.weights)
        if mode == "persistent":
            _chain_kernel[(programs,)](*args, 0, stages, PERSISTENT=True, **meta)
        elif mode == "pdl":
            for s in range(stages):
                _chain_kernel[(programs,)](*args, s, 1, PERSISTENT=False, **meta, **pdl.launch(self.act.device))
        elif mode == "gemv":
            from k3serve.ops.gemv_triton import gemv

            for s, w in enumerate(self.weights):
                gemv(self.acts[s][None], w, out=self.acts[s + 1][None])
        else:
            raise ValueError(f"mode {mode!r}: persistent, pdl or gemv")
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
    print("| dims | stage MB | variant | programs | tile (rows, k, first k, warps) | max rel err | us a stage | % of copy |")
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
        del chain
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

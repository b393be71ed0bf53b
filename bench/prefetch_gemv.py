"""Can a GEMV fetch its weights into shared memory *before* its PDL wait, while the short kernels
ahead of it run? At batch 1 a kimi-linear-48b step spends ~0.5 ms in ~180 short kernels that
move almost no bytes, then each GEMV streams its weights from cold and pays ~4 us of fixed cost
(RESULTS.md twentieth session). Weights never depend on the step's activations, so a GEMV
launched early (PDL: its predecessor lets it launch as soon as that predecessor has started)
can issue TMA copies of its share of the weight into a shared-memory ring first, then wait for
its input: a 19 MB weight is ~143 KB an SM, within one SM's shared memory. Earlier tries moved
the bytes only as far as L2 (tenth session: hints before the wait; twentieth: a side stream) or
a first tile into registers (``bench/gemv_chain.py``'s ``pdl``), and gained nothing.

The kernel: weights pre-tiled into contiguous [rows, k] chunks (``gemv_chain.tile_chunks``),
program p takes a balanced run of the chunks, issues the first RING of them, waits (PDL), copies
the input row into shared memory, sums chunk by chunk (fp32). A row block split between
programs is summed in an fp32 scratch with atomics; the last contributor (a ticket a row block)
writes the bf16 row and zeroes the scratch and the ticket for the next call.

Timed as ``bench/l2_prefetch.py`` times its chain: CUDA graphs over ``--layers`` weights (more
than L2), per layer ``--small`` route launches (``moe_triton``'s, PDL) then the GEMV; the served
GEMV against this one, with and without PDL. Each layer's output is checked against float64.
Not used by the model.

    python3 -m bench.prefetch_gemv [--layers 24] [--dims 2304,4096] [--dims 12544,2304] [--small 0,1,2]
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton

from k3serve.ops.gemv_triton import gemv
from k3serve.ops.moe_triton import route_triton

from .gemv_chain import tile_chunks


@functools.cache
def prefetch_gemv_kernel():
    """The Gluon kernel, built on first use (CPU tests import this module without building it)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from k3serve.ops.gluon_compat import async_load, cta_barrier, tma_load

    @gluon.jit
    def _griddepcontrol(ASM: gl.constexpr):
        gl.inline_asm_elementwise(ASM + " mov.u32 $0, 0;", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _owner(j, C, P):
        """The program whose run of chunks holds chunk j (runs: [C p / P, C (p + 1) / P))."""
        return (P * (j + 1) + C - 1) // C - 1

    @gluon.jit
    def _prefetch_gemv_kernel(desc, X, Y, S, TICKETS, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              MAX_KB: gl.constexpr, RING: gl.constexpr, WARPS: gl.constexpr,
                              USE_PDL: gl.constexpr):
        """Y[N] = W X[K] (bf16, fp32 sums), W pre-tiled; see the module docstring."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [WARPS, 1], [1, 0])
        x_layout: gl.constexpr = gl.BlockedLayout([8], [32], [WARPS], [0])  # (16-byte copies; warps past
        # the row's width copy the same bytes again)
        pid = gl.program_id(0)
        P = gl.num_programs(0)
        n_kb = K // BLOCK_K
        C = (N // BLOCK_N) * n_kb
        j0 = (C * pid) // P
        n = (C * (pid + 1)) // P - j0
        ring = gl.allocate_shared_memory(desc.dtype, [RING, BLOCK_N, BLOCK_K], desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
        x_smem = gl.allocate_shared_memory(X.dtype.element_ty, [MAX_KB, BLOCK_K],  # (a row a K block)
                                           gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0]))
        for i in gl.static_range(RING):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(RING):  # the weights first: they depend on nothing
            mbarrier.expect(bars.index(i), desc.block_type.nbytes, pred=i < n)
            tma_load(desc, [(j0 + i) * BLOCK_N, 0], bars.index(i), ring.index(i), pred=i < n)
        if USE_PDL:  # then the input, once the previous kernel is done
            _griddepcontrol("griddepcontrol.wait;")
            _griddepcontrol("griddepcontrol.launch_dependents;")
        ks = gl.arange(0, BLOCK_K, layout=x_layout)
        for i in gl.static_range(MAX_KB):
            async_load(x_smem.index(i), X + i * BLOCK_K + ks, mask=(ks * 0 + i * BLOCK_K) < K)
        async_copy.commit_group()
        async_copy.wait_group(0)
        cta_barrier()
        rows_in = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        kb = j0 % n_kb
        rb = j0 // n_kb
        for g in range(0, n):
            slot = g % RING
            mbarrier.wait(bars.index(slot), (g // RING) & 1)
            w = ring.index(slot).load(layout)
            xk = x_smem.index(kb).load(gl.SliceLayout(0, layout))
            acc += w.to(gl.float32) * xk.to(gl.float32)[None, :]
            if (kb == n_kb - 1) | (g == n - 1):  # this program's share of a row block done
                rows = rb * BLOCK_N + rows_in
                part = gl.sum(acc, 1)
                contributors = _owner(rb * n_kb + n_kb - 1, C, P) - _owner(rb * n_kb, C, P) + 1
                if contributors == 1:
                    gl.store(Y + rows, part.to(Y.dtype.element_ty))
                else:
                    gl.atomic_add(S + rows, part, sem="relaxed", scope="gpu")
                    cta_barrier()  # (every thread's sums before the ticket's release)
                    ticket = gl.atomic_add(TICKETS + rb, 1, sem="acq_rel", scope="gpu")
                    if ticket == contributors - 1:  # the last one: write the row, clear for the next call
                        total = gl.load(S + rows, cache_modifier=".cg")
                        gl.store(Y + rows, total.to(Y.dtype.element_ty))
                        gl.store(S + rows, gl.zeros_like(total))
                        gl.store(TICKETS + rb, 0)
                acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
            cta_barrier()  # every thread done with the slot
            refill = g + RING < n
            mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=refill)
            tma_load(desc, [(j0 + g + RING) * BLOCK_N, 0], bars.index(slot), ring.index(slot), pred=refill)
            kb += 1
            if kb == n_kb:
                kb = 0
                rb += 1
        for i in gl.static_range(RING):
            mbarrier.invalidate(bars.index(i))

    return _prefetch_gemv_kernel


class PrefetchGemv:
    """One weight [N, K] (bf16) tiled for the kernel, its descriptor and its scratch."""

    def __init__(self, w: torch.Tensor, block_n: int, block_k: int):
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        self.n, self.k = w.shape
        self.block_n, self.block_k = block_n, block_k
        self.tiled = tile_chunks(w, block_n, block_k).contiguous()
        layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)
        self.desc = TensorDescriptor.from_tensor(self.tiled, [block_n, block_k], layout)
        self.scratch = torch.zeros(self.n, dtype=torch.float32, device=w.device)
        self.tickets = torch.zeros(self.n // block_n, dtype=torch.int32, device=w.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor, programs: int, ring: int, warps: int, pdl: bool):
        if (self.n // self.block_n) * (self.k // self.block_k) < programs:
            raise ValueError("fewer chunks than programs")
        prefetch_gemv_kernel()[(programs,)](
            self.desc, x, out, self.scratch, self.tickets, self.n, self.k, BLOCK_N=self.block_n,
            BLOCK_K=self.block_k, MAX_KB=triton.next_power_of_2(self.k // self.block_k), RING=ring, WARPS=warps,
            USE_PDL=pdl, num_warps=warps, launch_pdl=pdl)


class Layers:
    """``layers`` GEMV weights [N, K] (bf16), one input row, the route kernel's inputs; the GEMV
    served (``ops/gemv_triton.py``) or this module's."""

    def __init__(self, n: int, k: int, layers: int, gen: torch.Generator):
        self.w = [torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(layers)]
        self.x = torch.randn(k, generator=gen, device="cuda").to(torch.bfloat16)
        self.out = torch.zeros(layers, n, dtype=torch.bfloat16, device="cuda")
        self.logits = torch.randn(18, 1, 256, generator=gen, device="cuda")  # kimi-linear's router parts
        self.ref = torch.stack([(w.double() @ self.x.double()) for w in self.w])
        self.tiled: dict = {}

    def step(self, small: int, form: dict | None) -> None:
        if form is not None and (form["block_n"], form["block_k"]) not in self.tiled:
            self.tiled = {(form["block_n"], form["block_k"]): [PrefetchGemv(w, form["block_n"], form["block_k"])
                                                               for w in self.w]}  # (one tiling at a time)
        for i, w in enumerate(self.w):
            for _ in range(small):
                route_triton(self.logits, None, 8, True, 2.446)
            if form is None:
                gemv(self.x[None], w, out=self.out[i][None])
            else:
                self.tiled[form["block_n"], form["block_k"]][i](
                    self.x, self.out[i], form["programs"], form["ring"], form["warps"], form["pdl"])

    def max_rel_err(self) -> float:
        return ((self.out.double() - self.ref).abs().max() / self.ref.abs().max()).item()


def main() -> None:
    from .ceilings import copy_bench_setup
    from .timing import gpu_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dims", action="append", default=None, help="N,K of the GEMV weight")
    ap.add_argument("--small", default="0,1,2", help="route launches before each GEMV")
    args = ap.parse_args()
    copy, programs, gen = copy_bench_setup()
    # (rows, k, ring slots, warps): rings of 128-192 KB, a 19 MB weight's whole share an SM at 9 x 16 KB
    tiles = ((32, 256, 9, 4), (32, 256, 12, 4), (16, 256, 16, 4), (64, 256, 6, 8))
    forms = [("served", None)] + [
        (f"prefetch {'pdl' if pdl else 'no pdl'} {t}", dict(block_n=t[0], block_k=t[1], ring=t[2], warps=t[3],
                                                            programs=programs, pdl=pdl))
        for t in tiles for pdl in (True, False)]
    for spec in args.dims or ["2304,4096", "12544,2304"]:
        n, k = (int(d) for d in spec.split(","))
        layers = Layers(n, k, args.layers, gen)
        mb = n * k * 2 / 1e6
        print(f"### {spec}: {mb:.1f} MB a weight ({mb / copy:.2f} us at copy), {args.layers} layers of "
              "(route x small, GEMV), us a layer\n")
        print("| small | GEMV | max rel err vs float64 | us a layer | vs served |\n|---|---|---|---|---|")
        for small in (int(s) for s in args.small.split(",")):
            base = None
            for name, form in forms:
                layers.out.zero_()
                try:
                    layers.step(small, form)
                    torch.cuda.synchronize()
                    err = layers.max_rel_err()
                    if err > 2e-2:  # (bf16 output rounding ~4e-3): wrong, not timed
                        print(f"| {small} | {name} | {err:.1e}: wrong, not timed | | |", flush=True)
                        continue
                    us = gpu_ms(lambda: layers.step(small, form), cold=False, calls=2) * 1e3 / args.layers
                except Exception as exc:  # a tile that does not fit: say so, go on
                    print(f"| {small} | {name} | failed: {repr(exc)[:100]} | | |", flush=True)
                    continue
                base = base or us
                print(f"| {small} | {name} | {err:.1e} | {us:.2f} | {us - base:+.2f} |", flush=True)
        print()
        layers = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

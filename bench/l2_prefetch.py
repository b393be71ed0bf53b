"""Can a decode step's short kernels hide the next weights' DRAM reads? At batch 1 a kimi-linear-48b
step spends ~0.5 ms in ~180 kernels of 2-6 us that move almost no bytes (add + norm, route, the
KDA mixer, combine...: RESULTS.md nineteenth session), while DRAM idles; then each GEMV streams
its weights from cold. Here a side stream, forked where the short kernels start, hints the next
GEMV's weights into L2 (the weights never depend on the step's activations), so the GEMV would
read them from L2. (The tenth session hinted a kernel's *own* weights before its PDL wait: that
only overlapped the previous kernel's tail, and lost.)

Timed from CUDA graphs over ``--layers`` weights (more bytes than L2, so nothing stays warm
between layers), per layer: ``--small`` route launches (ops/moe_triton.py's, ~4 us each, as in a
MoE layer) then the served GEMV, with and without the side-stream prefetch, bulk
(``cp.async.bulk.prefetch.L2``, one instruction a chunk) or a line at a time
(``prefetch.global.L2::evict_last``), the whole weight or its first part. First: does a prefetch
finished before the GEMV starts make the GEMV faster at all (the GEMV's time after the prefetch
and a sleep, less the prefetch and sleep alone)? Outputs are checked against the GEMV without
prefetch (a hint must change nothing). Not used by the model. Answer on the H200 (RESULTS.md
twentieth session): no; even a finished prefetch only takes a 19 MB GEMV from 8.5 to 6.7 us (the
rest is the launch's fixed cost), and forked during the short kernels it gains at most noise.

    python3 -m bench.l2_prefetch [--layers 24] [--dims 2304,4096] [--dims 12544,2304] [--small 1,2]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from k3serve.ops.gemv_triton import gemv
from k3serve.ops.moe_triton import route_triton


@triton.jit
def _prefetch_l2_kernel(PTR, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr, BULK: tl.constexpr):
    """Program p hints chunks p * LANES .. of [PTR, PTR + nbytes) into L2, a lane a chunk (the last
    chunk clamped inside the buffer), bulk or a 128-byte line at a time."""
    base = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    stride = tl.num_programs(0).to(tl.int64) * LANES * CHUNK
    size = tl.full([LANES], CHUNK, tl.int32)
    for start in range(0, nbytes, stride):
        p = PTR + tl.minimum(start + base, nbytes - CHUNK)
        if BULK:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                                      [p, size], dtype=tl.int32, is_pure=False, pack=1)
        else:
            for line in tl.static_range(0, CHUNK, 128):
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l",
                                          [p + line], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor, fraction: float = 1.0, bulk: bool = True, programs: int = 16,
                chunk: int = 16384) -> None:
    """Hint the first ``fraction`` of ``t``'s bytes (dense) into L2."""
    raw = t.view(-1).view(torch.uint8)
    nbytes = (int(raw.numel() * fraction) // 16) * 16
    chunk = chunk if bulk else 1024
    if nbytes < chunk:
        return
    _prefetch_l2_kernel[(programs,)](raw, nbytes, CHUNK=chunk, LANES=128, BULK=bulk, num_warps=4)


class Layers:
    """``layers`` GEMV weights [N, K] (bf16), one input row, and the route kernel's inputs."""

    def __init__(self, n: int, k: int, layers: int, gen: torch.Generator):
        self.w = [torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(layers)]
        self.x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        self.out = torch.empty(layers, 1, n, dtype=torch.bfloat16, device="cuda")
        self.logits = torch.randn(18, 1, 256, generator=gen, device="cuda")  # kimi-linear's router parts
        self.side = torch.cuda.Stream()

    def step(self, small: int, prefetch: dict | None) -> None:
        main = torch.cuda.current_stream()
        for i, w in enumerate(self.w):
            if prefetch is not None:
                self.side.wait_stream(main)  # the hint starts with this layer's short kernels
                with torch.cuda.stream(self.side):
                    prefetch_l2(w, **prefetch)
            for _ in range(small):
                route_triton(self.logits, None, 8, True, 2.446)
            gemv(self.x, w, out=self.out[i])
        if prefetch is not None:
            main.wait_stream(self.side)


def main() -> None:
    from .ceilings import copy_bench_setup
    from .timing import gpu_ms

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dims", action="append", default=None, help="N,K of the GEMV weight")
    ap.add_argument("--small", default="1,2", help="route launches before each GEMV")
    args = ap.parse_args()
    copy, _, gen = copy_bench_setup()
    variants = [("none", None)] + [
        (f"{'bulk' if bulk else 'lines'} {frac:g} x{programs}", dict(bulk=bulk, fraction=frac, programs=programs))
        for bulk in (True, False) for frac in (1.0, 0.5) for programs in (8, 32)]
    for spec in args.dims or ["2304,4096", "12544,2304"]:
        n, k = (int(d) for d in spec.split(","))
        layers = Layers(n, k, args.layers, gen)
        mb = layers.w[0].numel() * 2 / 1e6
        floor_us = mb / copy

        # 1. a prefetch that has finished (the sleep covers its DRAM traffic) before the GEMV starts
        w = layers.w[0]
        sleep = lambda: torch.cuda._sleep(200_000)  # noqa: E731 (~100 us)
        print(f"### {spec}: {mb:.1f} MB a weight; GEMV after a finished prefetch (us, cold L2 otherwise)\n")
        print("| prefetch | GEMV us | % of copy |\n|---|---|---|")
        for name, pf in variants:
            pre = (lambda: (prefetch_l2(w, **pf), sleep())) if pf else sleep  # noqa: E731
            both = gpu_ms(lambda: (pre(), gemv(layers.x, w, out=layers.out[0])), calls=4)
            alone = gpu_ms(pre, calls=4)
            us = max(both - alone, 1e-6) * 1e3
            print(f"| {name} | {us:.2f} | {100 * floor_us / us:.0f} % |", flush=True)

        # 2. the chain: short kernels, then the GEMV, per layer
        layers.step(1, None)
        ref = layers.out.clone()
        print(f"\n### {spec}: {args.layers} layers of (route x small, GEMV), us a layer\n")
        print("| small | prefetch | outputs equal | us a layer | vs none |\n|---|---|---|---|---|")
        for small in (int(s) for s in args.small.split(",")):
            base = None
            for name, pf in variants:
                layers.out.zero_()
                layers.step(small, pf)
                torch.cuda.synchronize()
                same = torch.equal(layers.out, ref)
                us = gpu_ms(lambda: layers.step(small, pf), cold=False, calls=2) * 1e3 / args.layers
                base = base or us
                print(f"| {small} | {name} | {'yes' if same else 'NO'} | {us:.2f} | {us - base:+.2f} |", flush=True)
        print()


if __name__ == "__main__":
    main()

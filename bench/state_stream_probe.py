"""How fast can the KDA decode's state traffic go at all? ([gpu-kernels] item 1's 90 % target.)

The fused decode mixer moves each sequence's [H, D, D] fp32 state once in and once out, in place at
its pool slot. Earlier probes (``bench.kernels_kda_decode.state_probes``: a program a tile, one
load, one store) reached 91-93 % of the copy ceiling and the mixer 79-83 %; ncu showed throughput
following the bytes an SM holds in flight, which registers cap. This probe asks whether a
pipelined stream lifts that ceiling: persistent programs walking the (sequence, head, value block)
tiles with ``num_stages`` loads in flight (TMA descriptors or pointers), in place or out to a
second pool, beside torch's own copy and in-place multiply and a flat Triton stream of the same
bytes. Not a model kernel: each Triton variant scales the state by 0.999 and is checked against
that before it is timed.

``--tiles``: a program a tile again (no pipeline), asking what separates the tiles' 86-93 % from
the flat stream's 97-99 %: the tile's layout (key rows first [D, BV] as served, value rows first
[BV, D], one contiguous run) and size, the launch order (sequences fastest, as the served grid
(N, H, parts) runs, or memory order: value blocks, then heads, then sequences) and the slot
lookup (a dependent load before the state's, at random slots, or the sequence's own dense block).

Usage: python -m bench.state_stream_probe [--quick | --flat | --tiles]  (--flat: the dense rows alone)
"""

import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.ceilings import copy_bench_setup
from bench.timing import gpu_ms


@triton.jit
def _stream_kernel(SRC, DST, SRC_PTR, DST_PTR, SLOTS, n_tiles, stride_slot, H, D: tl.constexpr,
                   BV: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr):
    """Program p scales tiles p, p + P, ... (tile = sequence, head, value block) from SRC's slot to
    DST's slot (the same pool when in place)."""
    NVB: tl.constexpr = D // BV
    dk = tl.arange(0, D)
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        vb = t % NVB
        h = (t // NVB) % H
        slot = tl.load(SLOTS + t // (NVB * H))
        if TMA:
            s = SRC.load([slot, h, 0, vb * BV])
            DST.store([slot, h, 0, vb * BV], s * 0.999)
        else:
            off = slot.to(tl.int64) * stride_slot + h * D * D + dk[:, None] * D + vb * BV + tl.arange(0, BV)[None, :]
            s = tl.load(SRC_PTR + off)
            tl.store(DST_PTR + off, s * 0.999)


@triton.jit
def _flat_kernel(X, BLOCK: tl.constexpr):
    """The same bytes as torch's in-place scale sees them: one contiguous run a program."""
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(X + off, tl.load(X + off) * 0.999)


@triton.jit
def _tile_kernel(POOL, SLOTS, N, H, stride_slot, D: tl.constexpr, BV: tl.constexpr, V_FIRST: tl.constexpr,
                 MEM_ORDER: tl.constexpr, INDIRECT: tl.constexpr):
    """One (sequence, head, value block) tile a program, scaled in place."""
    NVB: tl.constexpr = D // BV
    pid = tl.program_id(0)
    if MEM_ORDER:
        vb = pid % NVB
        h = (pid // NVB) % H
        n = pid // (NVB * H)
    else:
        n = pid % N
        h = (pid // N) % H
        vb = pid // (N * H)
    if INDIRECT:
        slot = tl.load(SLOTS + n).to(tl.int64)
    else:
        slot = n.to(tl.int64)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    if V_FIRST:
        tile = dv[:, None] * D + dk[None, :]
    else:
        tile = dk[:, None] * D + dv[None, :]
    ptr = POOL + slot * stride_slot + h * D * D + tile
    tl.store(ptr, tl.load(ptr) * 0.999)


def tiles(N: int, pool: torch.Tensor, slots: torch.Tensor, report) -> None:
    """The ``--tiles`` rows at one N (each variant checked before it is timed)."""
    H, D = pool.shape[1], pool.shape[2]
    for indirect in (True, False):
        for mem_order in (False, True):
            for v_first in (False, True):
                for bv in (8, 16, 32, 64, 128):
                    for warps in (4, 8):
                        run = lambda: _tile_kernel[(N * H * (D // bv),)](  # noqa: E731
                            pool, slots, N, H, pool.stride(0), D=D, BV=bv, V_FIRST=v_first, MEM_ORDER=mem_order,
                            INDIRECT=indirect, num_warps=warps)
                        rows = slots.long() if indirect else torch.arange(N, device=pool.device)
                        before = pool[rows].clone()
                        run()
                        if not torch.allclose(pool[rows], before * 0.999, rtol=1e-6, atol=0):
                            raise AssertionError(f"tile probe {indirect, mem_order, v_first, bv, warps}: wrong")
                        del before
                        label = (f"tiles, {'random slots' if indirect else 'dense'}, "
                                 f"{'memory order' if mem_order else 'sequences fastest'}, "
                                 f"{'[BV, D]' if v_first else '[D, BV]'}, BV {bv} ({D * bv * 4 // 1024} KB), "
                                 f"{warps} warps")
                        report(label, gpu_ms(run, rep=200))


def _variants(quick: bool):
    """(TMA, in place, BV, warps, stages, programs an SM)."""
    out = []
    for tma in (True, False):
        for bv in (32, 64):
            for stages in ((2, 3, 4) if tma else (1, 2, 3)):
                for per_sm in (1, 2, 4):
                    for warps in (4, 8):
                        if quick and (warps == 8 or per_sm == 4):
                            continue
                        out.append((tma, True, bv, warps, stages, per_sm))
    out += [(True, False, 64, 4, s, p) for s in (2, 3) for p in (1, 2)]  # out to a second pool
    return out


def main() -> None:
    quick = "--quick" in sys.argv
    ceil, sms, _ = copy_bench_setup()
    H, D = 96, 128
    print("| N | variant | ms | TB/s | % copy |\n|---|---|---|---|---|")
    for N in (64, 256):
        nbytes = N * H * D * D * 8
        pool = torch.randn(N + 8, H, D, D, device="cuda")
        second = torch.zeros_like(pool)
        slots = torch.randperm(N + 8, device="cuda")[:N].to(torch.int32)
        dense = pool[:N].clone()
        dense_out = torch.empty_like(dense)

        def report(label, ms):
            tbs = nbytes / (ms * 1e-3) / 1e12
            print(f"| {N} | {label} | {ms:.3f} | {tbs:.2f} | {100 * tbs / ceil:.1f} % |", flush=True)

        report("torch copy_ of the same bytes (dense)", gpu_ms(lambda: dense_out.copy_(dense), rep=200))
        report("torch mul_ in place (dense)", gpu_ms(lambda: dense.mul_(1.0), rep=200))
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8):
                run = lambda: _flat_kernel[(dense.numel() // block,)](dense, BLOCK=block, num_warps=warps)  # noqa: E731
                before = dense.clone()
                run()
                if not torch.allclose(dense, before * 0.999, rtol=1e-6, atol=0):
                    raise AssertionError(f"flat stream, {block} a program, {warps} warps: wrong")
                report(f"Triton flat in place (dense), {block} a program, {warps} warps", gpu_ms(run, rep=200))
        if "--tiles" in sys.argv:
            tiles(N, pool, slots, report)
        if "--flat" in sys.argv or "--tiles" in sys.argv:
            continue
        for tma, in_place, bv, warps, stages, per_sm in _variants(quick):
            dst = pool if in_place else second
            block = [1, 1, D, bv]
            src_d = TensorDescriptor(pool, list(pool.shape), list(pool.stride()), block)
            dst_d = TensorDescriptor(dst, list(dst.shape), list(dst.stride()), block)
            n_tiles = N * H * (D // bv)
            run = lambda: _stream_kernel[(min(n_tiles, per_sm * sms),)](  # noqa: E731
                src_d, dst_d, pool, dst, slots, n_tiles, pool.stride(0), H, D=D, BV=bv, STAGES=stages, TMA=tma,
                num_warps=warps)
            label = (f"{'TMA' if tma else 'pointers'}, {'in place' if in_place else 'out'}, BV {bv}, "
                     f"{warps} warps, {stages} stages, {per_sm}/SM")
            try:
                before = pool[slots.long()].clone()
                run()
                torch.cuda.synchronize()
                ok = torch.allclose(dst[slots.long()], before * 0.999, rtol=1e-6, atol=0)
                if not ok:
                    print(f"| {N} | {label} | WRONG | | |", flush=True)
                    continue
                report(label, gpu_ms(run, rep=200))
            except Exception as exc:  # a variant that does not compile (shared memory): say so, go on
                print(f"| {N} | {label} | failed: {repr(exc)[:90]} | | |", flush=True)


if __name__ == "__main__":
    main()

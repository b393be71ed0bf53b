"""What one dependency between two small kernels costs in a decode step's CUDA graph.

A kimi-linear-48b batch-1 step is ~315 kernels in one chain (2.55 ms against a 1.46 ms byte
floor), and every attempt to remove launches by moving their work into a neighbour lost
(RESULTS.md twenty-second session). This times the chain alone: LINKS kernels, each reading the
previous one's output row (2,304 bf16 values: the hidden state of kimi-linear) and writing its own
(+1, so the last row proves every read waited for its producer), captured in one graph and
replayed warm. Per link, by programs a kernel and with / without programmatic dependent launch
(ops/pdl.py): the floor under every small kernel and every grid-wide dependency of the step.

    python3 -m bench.hop_cost [--links 300]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from k3serve.ops import pdl
from k3serve.ops.pdl import pdl_start


@triton.jit
def _link_kernel(IN, OUT, D, READ: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Every program reads the whole row (a consumer needing all of its input, as a GEMV or a norm
    does) and writes its share of OUT = IN + 1; READ False: touches nothing (launch and wait only)."""
    pdl_start(USE_PDL)
    if READ:
        cols = tl.arange(0, BLOCK)
        row = tl.load(IN + cols, mask=cols < D, other=0.0).to(tl.float32)
        share = tl.cdiv(D, tl.num_programs(0))
        mine = (cols >= tl.program_id(0) * share) & (cols < (tl.program_id(0) + 1) * share) & (cols < D)
        tl.store(OUT + cols, (row + 1.0).to(OUT.dtype.element_ty), mask=mine)


def link_us(links: int, programs: int, read: bool, use_pdl: bool, d: int = 2304) -> float:
    """Microseconds a link of a graph-replayed chain of ``links`` kernels (median of 20 replays);
    the chain's result checked first."""
    rows = [torch.zeros(d, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    launch = pdl.launch(rows[0].device) if use_pdl else {}

    def chain():
        for i in range(links):
            _link_kernel[(programs,)](rows[i % 2], rows[(i + 1) % 2], d, READ=read,
                                      BLOCK=triton.next_power_of_2(d), **launch)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    if read:  # after `links` links from zeros (bf16 counts exactly to 256; beyond, rounding: check below it)
        rows[0].zero_()
        rows[1].zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = rows[links % 2].float()
        if links <= 256 and not torch.all(got == links):
            raise AssertionError(f"a link read before its producer wrote: {got.unique()[:8].tolist()}")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[10] * 1e3 / links


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", type=int, default=256)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), f"PDL available: {bool(pdl.launch(torch.device('cuda')))}")
    print("| kernel | programs | PDL | us a link |\n|---|---|---|---|")
    for read in (False, True):
        for programs in (1, 132, 264):
            for use_pdl in (False, True):
                us = link_us(args.links, programs, read, use_pdl)
                print(f"| {'reads the previous row, writes its share' if read else 'empty'} | {programs} | "
                      f"{'yes' if use_pdl else 'no'} | {us:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""The sampler's cost a decode step (engine/sampler.Sampler on [S, V] logits, V = kimi-linear's
163,840): the sorting torch path against the sort-free kernel (ops/sampling_triton.py), each call
eager as the engine makes it (host work included: CUDA events around back-to-back calls).

    python -m bench.kernels_sampling [--batches 1,16,64,256]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.ceilings import copy_tbs
from k3serve.engine import sampler as smp
from k3serve.engine.sampling_params import SamplingParams

SETTINGS = {"temperature 0.7, top-p 0.95": dict(temperature=0.7, top_p=0.95),
            "temperature 0.7, top-k 50, top-p 0.95": dict(temperature=0.7, top_k=50, top_p=0.95),
            "temperature 1.0, min-p 0.05": dict(temperature=1.0, min_p=0.05),
            "greedy": dict(temperature=0.0)}


def call_ms(sampler, logits, rows, calls: int = 30) -> float:
    for _ in range(3):
        sampler(logits, rows)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        sampler(logits, rows)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    copy = copy_tbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, copy {copy:.2f} TB/s\n\n| rows | sampling | torch (sort) us | kernel us | "
          f"speedup | kernel: logits read once, % of copy |\n|---|---|---|---|---|---|")
    rows_out = []
    for S in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(S, args.vocab, generator=gen, device="cuda") * 3
        for name, kw in SETTINGS.items():
            rows = [smp.SamplingRow(SamplingParams(**kw), [], [], [0]) for _ in range(S)]
            ms = {}
            for kernel in (False, True):
                smp.KERNEL = kernel
                ms[kernel] = call_ms(smp.Sampler(), logits, rows)
            smp.KERNEL = None
            frac = S * args.vocab * 4 / (ms[True] * 1e-3) / (copy * 1e12)
            rows_out.append({"rows": S, "sampling": name, "torch_us": round(ms[False] * 1e3, 1),
                             "kernel_us": round(ms[True] * 1e3, 1)})
            print(f"| {S} | {name} | {ms[False] * 1e3:.1f} | {ms[True] * 1e3:.1f} | {ms[False] / ms[True]:.2f}x | "
                  f"{100 * frac:.1f} % |", flush=True)
    with open(os.path.join(args.out, "kernels_sampling.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_TBps": copy, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()

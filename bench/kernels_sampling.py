"""The sampler's cost a decode step (engine/sampler.Sampler on [S, V] logits, V = kimi-linear's
163,840): the sorting torch path against the sort-free kernel (ops/sampling_triton.py), each call
eager as the engine makes it (host work included: CUDA events around back-to-back calls).

    python -m bench.kernels_sampling [--batches 1,16,64,256] [--bare "default;skip=0;block=256"]

``--bare``: the kernel alone (ops/sampling_triton.sample_filtered, no host work: graph-replayed,
bench/timing.gpu_ms) under each variant (``;`` between them, each ``default`` or ``key=value``
pairs of sample_filtered's keywords: stages, block, warps, skip, group_size), with the logits'
bytes over every full pass it makes (the row maximum, 8 a filter, the draw's logits and noise) as a
fraction of copy. ``--peaked``: logits of a model's shape (a few tokens far above the rest) for both tables.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.ceilings import copy_tbs
from bench.timing import gpu_ms
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


def make_logits(S: int, vocab: int, gen: torch.Generator, peaked: bool) -> torch.Tensor:
    """N(0, 3) logits, or ``peaked``: 20 tokens 15-20 above a bulk of scale 0.5 (a model's shape)."""
    if not peaked:
        return torch.randn(S, vocab, generator=gen, device="cuda") * 3
    logits = torch.randn(S, vocab, generator=gen, device="cuda") * 0.5
    return logits.scatter_(1, torch.randint(0, vocab, (S, 20), generator=gen, device="cuda"),
                           15 + 5 * torch.rand(S, 20, generator=gen, device="cuda"))


def parse_variants(text: str) -> list[dict]:
    """``default;skip=0;block=1024,stages=4`` -> [{}, {"skip": 0}, {"block": 1024, "stages": 4}]."""
    return [dict((k, int(v)) for k, v in (kv.split("=") for kv in var.split(",") if kv != "default"))
            for var in text.split(";")]


def bare_table(batches: list[int], vocab: int, variants: list[dict], copy: float,
               peaked: bool = False) -> list[dict]:
    from k3serve.ops.sampling_triton import PASSES, sample_filtered

    gen = torch.Generator(device="cuda").manual_seed(1)
    names = [",".join(f"{k}={v}" for k, v in var.items()) or "default" for var in variants]
    cols = " | ".join(f"{n} us" for n in names)
    print(f"\n| rows | sampling | {cols} | best: full passes' bytes, % of copy |"
          f"\n|---|---|{'---|' * len(variants)}---|")
    out = []
    for S in batches:
        logits = make_logits(S, vocab, gen, peaked)
        q = torch.empty(S, vocab, device="cuda").exponential_(generator=gen)
        rows = torch.arange(S, device="cuda")
        for name, kw in SETTINGS.items():
            if kw["temperature"] == 0.0:
                continue
            params = torch.tensor([[kw["temperature"]] * S, [kw.get("top_k", 0)] * S, [kw.get("top_p", 1.0)] * S,
                                   [kw.get("min_p", 0.0)] * S], device="cuda")
            has = (kw.get("top_k", 0) > 0, kw.get("top_p", 1.0) < 1.0, kw.get("min_p", 0.0) > 0)
            us = [1e3 * gpu_ms(lambda: sample_filtered(logits, rows, q, params, *has, **var)) for var in variants]
            passes = 1 + PASSES.value * (has[0] + has[1]) + 2  # (the draw reads logits and noise)
            frac = S * vocab * 4 * passes / (min(us) * 1e-6) / (copy * 1e12)
            out.append({"rows": S, "sampling": name, "us": dict(zip(names, us))})
            print(f"| {S} | {name} | {' | '.join(f'{u:.1f}' for u in us)} | {100 * frac:.1f} % |", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--vocab", type=int, default=163840)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--bare", default="", help="variants to time the kernel alone under (e.g. 'default;skip=0')")
    ap.add_argument("--skip-sampler", action="store_true", help="only the --bare table")
    ap.add_argument("--peaked", action="store_true", help="logits of a model's shape (make_logits)")
    args = ap.parse_args()
    copy = copy_tbs()
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, copy {copy:.2f} TB/s\n\n| rows | sampling | torch (sort) us | kernel us | "
          f"speedup | kernel: logits read once, % of copy |\n|---|---|---|---|---|---|")
    rows_out = []
    batches = [int(b) for b in args.batches.split(",")]
    for S in [] if args.skip_sampler else batches:
        logits = make_logits(S, args.vocab, gen, args.peaked)
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
    variants = parse_variants(args.bare) if args.bare else []
    bare = bare_table(batches, args.vocab, variants, copy, args.peaked) if variants else []
    with open(os.path.join(args.out, "kernels_sampling.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "copy_TBps": copy, "rows": rows_out, "bare": bare}, f,
                  indent=1)


if __name__ == "__main__":
    main()

"""GPU check of the engine path (run on the H200; not a CI test).

The engine runs the model on strided per-layer views of the unified pool (fla-core's kernels index
slots by the pool's stride) with continuous batching, chunked prefill, preemption and prefix
caching. This compares, in bf16 on CUDA, each request's greedy tokens from the engine with the
same request run alone through the model on plain contiguous caches, and the engine with prefix
caching on vs off. Random weights flip near-tied argmaxes under tiny numeric differences, so the
figure reported is the fraction of requests whose tokens match exactly, plus the first divergence.

Usage: python bench/gpu_check_engine.py [--preset tiny] [--num-prompts 24]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.loader import load_model


def alone(model, prompt: list[int], n: int) -> list[int]:
    dev = next(model.parameters()).device
    pages = list(range(-(-(len(prompt) + n) // 64)))
    caches = CacheHandles.allocate(model.config, 1, len(pages), 64, device=dev, dtype=model.dtype)
    logits = model.compute_logits(model(ForwardBatch.build([SeqChunk(prompt, 0, 0, pages)], 64, dev), caches))
    out = []
    for i in range(n):
        tok = int(logits[-1].argmax())
        out.append(tok)
        b = ForwardBatch.build([SeqChunk([tok], len(prompt) + i, 0, pages)], 64, dev)
        logits = model.compute_logits(model(b, caches))
    return out


def run_engine(model, prompts, n, **cfg) -> list[list[int]]:
    eng = LLMEngine(model, None, EngineConfig(**cfg))
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    stats = eng.stats()
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return [done[i] for i in ids], stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    model = load_model(preset=args.preset, device=args.device, dtype=args.dtype, seed=0)
    rng = random.Random(0)
    vocab = model.config.vocab_size - 256
    system = [rng.randrange(vocab) for _ in range(150)]
    prompts = [system + [rng.randrange(vocab) for _ in range(rng.randrange(5, 300))] for _ in range(args.num_prompts)]
    ref = [alone(model, p, args.tokens) for p in prompts]
    res = {}
    for name, cfg in {
        "engine, cache off": dict(enable_prefix_caching=False, max_num_batched_tokens=256, cache_memory="4GiB"),
        "engine, cache on": dict(enable_prefix_caching=True, prefix_block_size=64, kda_checkpoint_interval=128,
                                 max_num_batched_tokens=256, cache_memory="4GiB"),
    }.items():
        outs, stats = run_engine(model, prompts, args.tokens, **cfg)
        same = [o == r for o, r in zip(outs, ref)]
        first_div = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, r in zip(outs, ref)]
        res[name] = dict(exact=sum(same) / len(same), first_divergence=[d for d in first_div if d is not None],
                         prefix=stats.get("prefix"), preemptions=stats["preemptions"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

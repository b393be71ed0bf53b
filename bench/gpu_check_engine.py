"""GPU check of the engine path (run on the H200; not a CI test).

The engine runs the model on strided per-layer views of the unified pool (fla-core's kernels index
slots by the pool's stride) with continuous batching, chunked prefill, preemption and prefix
caching. This compares, in bf16 on CUDA, each request's greedy tokens from the engine with the
same request run alone through the model on plain contiguous caches, and the engine with prefix
caching on vs off. By default the model is the bundled trained one and the prompts are real code
(its held-out sample), so top-1 margins are meaningful; random weights (``--preset``) flip near-tied
argmaxes under any numeric difference. Reported: the fraction of requests whose tokens match
exactly, the first divergence of the others and the alone run's top-1 margin there.

Usage: python bench/gpu_check_engine.py [--model tiny | --preset tiny] [--num-prompts 24]
"""

from __future__ import annotations

import argparse
import json
import random

import torch

from k3serve.bundled import resolve_model
from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.loader import load_model
from k3serve.tokenizer import load_tokenizer


def alone(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens of ``prompt`` run alone on contiguous caches, with each step's top-1 margin."""
    dev = next(model.parameters()).device
    pages = list(range(-(-(len(prompt) + n) // 64)))
    caches = CacheHandles.allocate(model.config, 1, len(pages), 64, device=dev, dtype=model.dtype)
    logits = model.compute_logits(model(ForwardBatch.build([SeqChunk(prompt, 0, 0, pages)], 64, dev), caches))
    out, margins = [], []
    for i in range(n):
        top = logits[-1].float().topk(2)
        out.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        b = ForwardBatch.build([SeqChunk([out[-1]], len(prompt) + i, 0, pages)], 64, dev)
        logits = model.compute_logits(model(b, caches))
    return out, margins


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
    ap.add_argument("--model", default=None, help="checkpoint dir or bundled name (default: the bundled tiny)")
    ap.add_argument("--preset", default=None, help="random weights of a preset instead (prompts: random ids)")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    rng = random.Random(0)
    with torch.inference_mode():
        if args.preset:
            model = load_model(preset=args.preset, device=args.device, dtype=args.dtype, seed=0)
            vocab = model.config.vocab_size - 256
            text = [rng.randrange(vocab) for _ in range(20000)]
        else:
            path = resolve_model(args.model)
            model = load_model(path, device=args.device, dtype=args.dtype)
            text = load_tokenizer(path).encode((path / "heldout_sample.txt").read_text())
        system = text[:150]  # shared by every prompt: prefix caching has something to reuse
        starts = [rng.randrange(150, len(text) - 300) for _ in range(args.num_prompts)]
        prompts = [system + text[s:s + rng.randrange(5, 300)] for s in starts]
        ref = [alone(model, p, args.tokens) for p in prompts]
    res = {}
    for name, cfg in {
        "engine, cache off": dict(enable_prefix_caching=False, max_num_batched_tokens=256, cache_memory="4GiB"),
        "engine, cache on": dict(enable_prefix_caching=True, prefix_block_size=64, kda_checkpoint_interval=128,
                                 max_num_batched_tokens=256, cache_memory="4GiB"),
    }.items():
        outs, stats = run_engine(model, prompts, args.tokens, **cfg)
        first_div = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), None) for o, (r, _) in zip(outs, ref)]
        res[name] = dict(exact=sum(d is None for d in first_div) / len(first_div),
                         first_divergence=[d for d in first_div if d is not None],
                         margin_there=[round(m[d], 4) for d, (_, m) in zip(first_div, ref) if d is not None],
                         prefix=stats.get("prefix"), preemptions=stats["preemptions"])
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

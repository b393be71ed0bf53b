"""Offline engine throughput (issue [engine-core]) and unified-vs-static pool admission.

Throughput: N requests with random input and output lengths (token ids, ignore_eos) through the
real engine on a preset with dummy weights; reports output tokens/s, the step-time split
(schedule / prepare / forward / sample / output), peak pool occupancy per cache kind, preemptions.
Stops adding work after --max-seconds and reports what finished (so a slow reference path still
gives a figure inside a device lease).

Admission (--admission): the unified pool vs a static split at equal bytes on a skewed workload
(many short requests, then a few long ones), counting how many requests each admits before the
first one that does not fit. Pure accounting over the real unit sizes (pool on the meta device),
so it runs anywhere.

Usage:
  python bench/engine_throughput.py --preset kimi-linear-48b --num-prompts 64 --max-seconds 200
  python bench/engine_throughput.py --admission --preset k3 --pool-gib 60
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time

import torch

from k3serve.cache.pool import UnifiedPool
from k3serve.config import ModelConfig
from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.presets import preset_config


def throughput(args) -> dict:
    cfg = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       gpu_memory_utilization=args.gpu_memory_utilization, cache_memory=args.cache_memory)
    t0 = time.perf_counter()
    eng = LLMEngine.from_pretrained(preset=args.preset, config=cfg, device=args.device, dtype=args.dtype)
    load_s = time.perf_counter() - t0
    eng.runner.sync_timings = args.sync_timings
    rng = random.Random(0)
    vocab = eng.model.config.vocab_size - 256
    for i in range(args.num_prompts):
        n_in = rng.randint(args.min_input, args.max_input)
        n_out = rng.randint(args.min_output, args.max_output)
        eng.add_request([rng.randrange(vocab) for _ in range(n_in)],
                        SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True), request_id=str(i))
    # Warm-up step outside the clock (fla autotunes its kernels on first use).
    t_warm = time.perf_counter()
    eng.step()
    warm_s = time.perf_counter() - t_warm
    for k in eng.timings:
        eng.timings[k] = 0.0
    for k in eng.runner.timings:
        eng.runner.timings[k] = 0.0
    start = time.perf_counter()
    out_tokens = finished = steps = 0
    peak = dict(used=0, kda=0, mla=0)
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        for o in outs:
            out_tokens += len(o.outputs[0].delta_token_ids)
            finished += o.finished
        st = eng.pool.stats()
        if st["used_bytes"] > peak["used"]:
            peak = dict(used=st["used_bytes"], kda=st["kda_bytes"], mla=st["mla_bytes"])
        elapsed = time.perf_counter() - start
        if elapsed > args.max_seconds:
            break
        if steps % 500 == 0:  # progress survives a run killed from outside
            print(json.dumps(dict(seconds=round(elapsed, 1), steps=steps, finished=finished, output_tokens=out_tokens,
                                  output_tok_per_s=round(out_tokens / elapsed, 1))), flush=True)
    if eng.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    timings = {**eng.timings, **eng.runner.timings}
    return dict(preset=args.preset, device=torch.cuda.get_device_name() if eng.device.type == "cuda" else "cpu",
                requests=args.num_prompts, finished=finished, output_tokens=out_tokens, steps=steps,
                seconds=round(wall, 2), output_tok_per_s=round(out_tokens / wall, 1), load_s=round(load_s, 1),
                warmup_step_s=round(warm_s, 1), preemptions=eng.scheduler.num_preemptions,
                pool_gib=round(eng.pool.total_bytes / 2**30, 2),
                peak_pool_used=round(peak["used"] / eng.pool.total_bytes, 4),
                peak_kda_gib=round(peak["kda"] / 2**30, 3), peak_mla_gib=round(peak["mla"] / 2**30, 3),
                step_split_ms={k: round(1000 * v / max(steps, 1), 2) for k, v in timings.items()},
                truncated=bool(eng.has_unfinished_requests()))


def agentic(args) -> dict:
    """Sessions of several turns over one shared system prompt, growing context, short outputs;
    run with prefix caching on and off. Reports the token hit rate against the theoretical
    maximum (every token of the shared system prompt after its first use, plus every earlier
    turn's prompt), prefill tokens saved, and mean / p90 time to first token."""
    from k3serve.model.loader import load_model

    results = {}
    model = load_model(preset=args.preset, device=args.device, dtype=args.dtype)
    modes = [("warmup", False)] * args.warmup_runs + [("cache_off", False), ("cache_on", True)]
    for label, cache in modes:
        cfg = EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           gpu_memory_utilization=args.gpu_memory_utilization, cache_memory=args.cache_memory,
                           enable_prefix_caching=cache)
        eng = None  # free the previous mode's pool first: the new engine sizes its own from what is free
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        eng = LLMEngine(model, None, cfg)
        rng = random.Random(0)
        vocab = eng.model.config.vocab_size - 256
        system = [rng.randrange(vocab) for _ in range(args.system_len)]
        sessions = [list(system) for _ in range(args.sessions)]
        eng.add_request(system + [1], SamplingParams(max_tokens=1))  # warm-up (kernel autotuning), not timed
        while eng.has_unfinished_requests():
            eng.step()
        if eng.prefix is not None:
            eng.prefix.clear()
            eng.prefix.stats = type(eng.prefix.stats)()
        ttft, prompt_tokens, max_reusable = [], 0, 0
        start = time.perf_counter()
        for turn in range(args.turns):
            arrive = {}
            for s in sessions:
                before = len(s) if turn else (args.system_len if s is not sessions[0] else 0)
                s += [rng.randrange(vocab) for _ in range(rng.randint(args.min_input, args.max_input))]
                max_reusable += before
                prompt_tokens += len(s)
                rid = eng.add_request(list(s), SamplingParams(max_tokens=rng.randint(args.min_output, args.max_output),
                                                              temperature=0.0, ignore_eos=True))
                arrive[rid] = (time.perf_counter(), s)
            while eng.has_unfinished_requests():
                for out in eng.step():
                    t, s = arrive[out.request_id]
                    if out.outputs[0].token_ids and out.request_id not in [r for r, _ in ttft]:
                        ttft.append((out.request_id, time.perf_counter() - t))
                    if out.finished:
                        s += out.outputs[0].token_ids
            print(f"{label}: turn {turn + 1} done, longest context {max(map(len, sessions))}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        ts = sorted(t for _, t in ttft)
        ps = eng.prefix_stats()
        if label == "warmup":
            continue
        results[label] = dict(
            seconds=round(wall, 2), requests=len(ts), prompt_tokens=prompt_tokens,
            theoretical_max_hit_rate=round(max_reusable / prompt_tokens, 4),
            hit_rate=round(ps.get("tokens_reused", 0) / prompt_tokens, 4),
            prefill_tokens_saved=ps.get("tokens_reused", 0), checkpoints_held=ps.get("checkpoints_held", 0),
            checkpoints_evicted=ps.get("checkpoints_evicted", 0),
            ttft_mean_ms=round(1000 * sum(ts) / len(ts), 1), ttft_p90_ms=round(1000 * ts[int(0.9 * (len(ts) - 1))], 1))
        print(json.dumps(results, indent=1), flush=True)  # partial results survive a cut-off run
        del eng
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return dict(preset=args.preset, sessions=args.sessions, turns=args.turns, system_len=args.system_len, **results)


def admission(args) -> dict:
    """Skewed workload: many short requests, then a few long ones, at equal pool bytes."""
    mcfg = ModelConfig.from_dict(preset_config(args.preset))
    total = int(args.pool_gib * 2**30)
    rng = random.Random(0)
    short = [rng.randint(500, 4000) for _ in range(args.num_short)]
    long = [rng.randint(100_000, 300_000) for _ in range(args.num_long)]
    result = {}
    modes = [("unified", None)] + [(f"static kda_fraction={f}", f) for f in args.kda_fractions]
    for name, frac in modes:
        pool = UnifiedPool(mcfg, total, torch.bfloat16, "meta", 64, kda_fraction=frac)
        admitted = {"short": 0, "long": 0}
        for kind, lengths in (("short", short), ("long", long)):
            for n in lengths:
                pages = -(-n // 64)
                if not pool.can_allocate(slots=1, pages=pages):
                    break
                pool.alloc_slot()
                for _ in range(pages):
                    pool.alloc_page()
                admitted[kind] += 1
        result[name] = dict(admitted_short=admitted["short"], admitted_long=admitted["long"],
                            total=admitted["short"] + admitted["long"],
                            used_fraction=round(pool.used_bytes / pool.total_bytes, 3))
    lay = UnifiedPool(mcfg, total, torch.bfloat16, "meta", 64).layout
    return dict(preset=args.preset, pool_gib=args.pool_gib, slot_mib=round(lay.slot_bytes / 2**20, 2),
                page_kib=round(lay.page_bytes / 2**10, 1), workload=f"{args.num_short} short (500-4000 tokens) "
                f"then {args.num_long} long (100K-300K tokens), admitted in order until the first that does not fit",
                modes=result)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--admission", action="store_true")
    ap.add_argument("--agentic", action="store_true")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=2048)
    ap.add_argument("--warmup-runs", type=int, default=1,
                    help="untimed passes over the whole workload first (kernel autotuning per length)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=1024)
    ap.add_argument("--min-output", type=int, default=100)
    ap.add_argument("--max-output", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--cache-memory", default=None)
    ap.add_argument("--max-seconds", type=float, default=1e9)
    ap.add_argument("--pool-gib", type=float, default=60.0)
    ap.add_argument("--num-short", type=int, default=100)
    ap.add_argument("--num-long", type=int, default=20)
    ap.add_argument("--kda-fractions", type=float, nargs="*", default=[0.25, 0.5, 0.75])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sync-timings", action="store_true",
                    help="synchronize after each forward so the step split charges GPU time to forward")
    args = ap.parse_args()
    res = admission(args) if args.admission else agentic(args) if args.agentic else throughput(args)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

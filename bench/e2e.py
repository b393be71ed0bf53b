"""End-to-end GPU timings: ``python -m bench.e2e`` (H200; not a CI test).

1. k3-slice (true K3 widths: 3 KDA + 1 MLA layers, MXFP4 experts, dummy weights): one decode step
   (inputs -> logits) at batch 1/16/64/256 and context 4K/32K against its byte floor, eager and as a
   CUDA graph when capturable; prefill of 8K/32K tokens in one forward against its FLOP floor.
2. kimi-linear-48b (dummy weights) through the real engine: time to first token and decode
   tokens/s at batch 1, 16 and 64 (prompts of 512 tokens, 32 new), then HF transformers'
   ``generate`` on the same shape in the same run when transformers has KimiLinear.

Floors: decode bytes = every non-routed weight + the routed experts a batch is expected to touch
(uniform routing: E (1 - (1 - k/E)^B) per layer) + KDA state read and written + MLA latents read;
prefill FLOPs = 2 x active parameters x tokens + causal MLA attention (QK and PV) + the KDA chunk
work (about 2 T H (4 K V + 64 (K + V))). Ceilings measured in the same run (bench/ceilings.py).
Record the printed tables in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import time
from pathlib import Path

import torch
import triton

# The fast path is what is timed: every Triton kernel on (K3SERVE_<OP>_BACKEND=torch compares one op).
os.environ.setdefault("K3SERVE_BACKEND", "triton")  # every op (ops/backend.py); per-op variables still win

from k3serve.cache.pool import PoolLayout, UnifiedPool  # noqa: E402
from k3serve.engine.decode_graphs import DecodeGraphs, capture_blockers  # noqa: E402
from k3serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.model.batch import ForwardBatch, SeqChunk  # noqa: E402
from k3serve.model.loader import load_model  # noqa: E402
from k3serve.model.moe import RoutedExperts  # noqa: E402

from .ceilings import copy_tbs, matmul_tflops  # noqa: E402

PAGE = 64


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_split(model) -> tuple[int, list[int], int]:
    """(bytes of everything but routed experts and the embedding table, routed-expert bytes per MoE
    layer, embedding row bytes)."""
    routed = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    routed_ids = {id(p) for m in routed for p in m.parameters()}
    emb = model.model.embed_tokens.weight
    rest = _bytes(p for p in model.parameters() if id(p) not in routed_ids and p is not emb)
    return rest, [_bytes(m.parameters()) for m in routed], emb.shape[1] * emb.element_size()


def decode_floor_bytes(model, batch: int, context: int) -> int:
    cfg = model.config
    rest, routed, row = weight_split(model)
    E, k = cfg.num_experts or 1, cfg.num_experts_per_token
    touched = E * (1 - (1 - k / E) ** batch) if routed else 0
    experts = sum(r / E * touched for r in routed)
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    kda = batch * cfg.num_kda_layers * H * D * D * 4 * 2
    mla = batch * (context + 1) * cfg.mla_cache_width * model.dtype.itemsize * cfg.num_mla_layers
    return int(rest + experts + batch * row + kda + mla)


def prefill_floor_flops(model, tokens: int) -> float:
    cfg = model.config
    rest, routed, _ = weight_split(model)
    E, k = cfg.num_experts or 1, cfg.num_experts_per_token
    lm = model.lm_head.weight.numel()
    per_byte = 1 / model.lm_head.weight.element_size()  # bf16 parameters per byte (MXFP4 counted below)
    active = (rest * per_byte - lm) + sum(r / E * k for r in routed) * (2 if cfg.expert_format == "mxfp4" else per_byte)
    attn = cfg.num_mla_layers * cfg.num_attention_heads * tokens * tokens * (cfg.qk_head_dim + cfg.v_head_dim)
    H, D = cfg.kda_num_heads, cfg.kda_head_dim
    kda = cfg.num_kda_layers * 2 * tokens * H * (4 * D * D + 64 * 2 * D)
    return 2 * active * tokens + 2 * lm + attn + kda  # logits of the last token only


def bench_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=50, return_mode="median")


def slice_decode(model, batches, contexts, copy_ceiling) -> list[dict]:
    rows = []
    graphs_ok = not capture_blockers(torch.device("cuda"))
    for ctx in contexts:
        pages_per = -(-(ctx + 1) // PAGE)
        for B in batches:
            lay = PoolLayout.for_model(model.config, model.dtype, PAGE)
            pool = UnifiedPool(model.config, B * (lay.slot_bytes + pages_per * lay.page_bytes) + (1 << 20),
                               model.dtype, "cuda", PAGE)
            slots = [pool.alloc_slot() for _ in range(B)]
            # a different token per sequence: identical tokens route every row to the same 16
            # experts and would time a batch as if it read one token's experts
            tokens = torch.randint(0, model.config.vocab_size - 300, (B,), generator=torch.Generator().manual_seed(B))
            chunks = [SeqChunk([int(tokens[i])], ctx, slots[i], [pool.alloc_page() for _ in range(pages_per)])
                      for i in range(B)]

            def eager():
                with torch.inference_mode():
                    return model.compute_logits(model(ForwardBatch.build(chunks, PAGE, "cuda"), pool.handles))

            t_eager = bench_ms(eager)
            t_graph = None
            if graphs_ok:
                g = DecodeGraphs(model, pool, B, pages_per, capture=True, buckets=[B])
                t_graph = bench_ms(lambda: g.run(chunks))
                del g
            floor = decode_floor_bytes(model, B, ctx)
            best = min(t for t in (t_eager, t_graph) if t is not None)
            rows.append({"context": ctx, "batch": B, "eager_ms": round(t_eager, 3),
                         "graph_ms": None if t_graph is None else round(t_graph, 3),
                         "floor_GB": round(floor / 1e9, 2), "floor_ms": round(floor / (copy_ceiling * 1e12) * 1e3, 3),
                         "pct_copy_ceiling": round(100 * floor / (best * 1e-3) / (copy_ceiling * 1e12), 1),
                         "tok_s": round(B / (best * 1e-3), 1)})
            print(rows[-1], flush=True)
            del pool, chunks
            torch.cuda.empty_cache()
    return rows


def slice_prefill(model, lengths, mm_ceiling) -> list[dict]:
    rows = []
    for T in lengths:
        pages = -(-T // PAGE)
        lay = PoolLayout.for_model(model.config, model.dtype, PAGE)
        pool = UnifiedPool(model.config, lay.slot_bytes + pages * lay.page_bytes + (1 << 20), model.dtype, "cuda", PAGE)
        slot = pool.alloc_slot()
        page_ids = [pool.alloc_page() for _ in range(pages)]
        ids = torch.randint(0, model.config.vocab_size - 300, (T,)).tolist()
        batch = ForwardBatch.build([SeqChunk(ids, 0, slot, page_ids)], PAGE, "cuda")

        def run():
            with torch.inference_mode():
                h = model(batch, pool.handles)
                return model.compute_logits(h[batch.logits_indices])

        ms = bench_ms(run)
        flops = prefill_floor_flops(model, T)
        rows.append({"tokens": T, "ms": round(ms, 2), "floor_TFLOP": round(flops / 1e12, 2),
                     "floor_ms": round(flops / (mm_ceiling * 1e12) * 1e3, 2),
                     "pct_matmul_ceiling": round(100 * flops / (ms * 1e-3) / (mm_ceiling * 1e12), 1),
                     "tok_s": round(T / (ms * 1e-3))})
        print(rows[-1], flush=True)
        del pool, batch
        torch.cuda.empty_cache()
    return rows


QUANTIZATION: str | None = None  # every engine part's --quantization (main sets it from the flag)


def engine_48b(max_seqs: int, max_model_len: int, prefill_graphs: str, **config) -> LLMEngine:
    return LLMEngine.from_pretrained(None, preset="kimi-linear-48b", dtype="bfloat16", device="cuda",
                                     load_format="dummy", quantization=QUANTIZATION, config=EngineConfig(**(dict(
                                         max_num_seqs=max_seqs, max_model_len=max_model_len,
                                         # (whole prompts in a step; a server's 1M context keeps 8,192)
                                         max_num_batched_tokens=max(8192, max_model_len) if max_model_len <= 65536
                                         else 8192,
                                         prefill_graphs=prefill_graphs) | config)))


def greedy_requests(eng: LLMEngine, batch: int, prompt_len: int, new_tokens: int, sampling: dict | None = None
                    ) -> list[tuple]:
    """``batch`` (random prompt of ``prompt_len`` tokens, ``new_tokens`` tokens) requests: greedy,
    or sampled with ``sampling`` (SamplingParams fields, e.g. temperature and top_p)."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, **(sampling or {"temperature": 0.0}))
    return [(p, params) for p in torch.randint(0, eng.model.config.vocab_size - 300, (batch, prompt_len)).tolist()]


def _tally(counts: dict, key: str, us: float) -> None:
    """counts[key] = (occurrences, total us)."""
    n, total = counts.get(key, (0, 0.0))
    counts[key] = (n + 1, total + us)


def engine_generate(batches, prompt_len, new_tokens, prefill_graphs: str = "auto",
                    max_model_len: int = 0, max_num_seqs: int = 0, sampling: dict | None = None) -> list[dict]:
    """kimi-linear-48b through LLMEngine: TTFT (all B first tokens) and decode tok/s after it.
    ``max_model_len`` 0: just what the requests need; a server's default is the model's context
    length (1M tokens), which sizes the static steps' block tables; ``max_num_seqs`` 0: the largest
    batch (a server's default: 256); ``sampling``: SamplingParams fields (None: greedy)."""
    eng = engine_48b(max_num_seqs or max(batches), max_model_len or prompt_len + new_tokens + 64, prefill_graphs)
    rows = []
    for B in batches:
        for attempt in ("warm-up", "timed"):
            requests = greedy_requests(eng, B, prompt_len, new_tokens, sampling)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for prompt, params in requests:
                eng.add_request(prompt, params)
            firsts, t_first = set(), None
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.outputs[0].token_ids:
                        firsts.add(out.request_id)
                if t_first is None and len(firsts) == B:
                    t_first = time.perf_counter()
            t_end = time.perf_counter()
        dec = (t_end - t_first) / (new_tokens - 1)
        rows.append({"batch": B, "experts": eng.model.config.expert_format, "prompt": prompt_len, "new": new_tokens,
                     "max_model_len": eng.max_model_len,
                     "max_num_seqs": eng.config.max_num_seqs, "sampling": ",".join(f"{k}={v}" for k, v in
                                                                                  (sampling or {}).items()) or "greedy",
                     "ttft_s": round(t_first - t0, 3),
                     "decode_ms_per_step": round(dec * 1e3, 2), "decode_tok_s": round(B / dec, 1),
                     "graph_steps": eng.runner.graph_steps, "prefill_graph_steps": eng.runner.prefill_graph_steps,
                     "overlapped_steps": eng.overlapped_steps})
        print(rows[-1], flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def engine_waves(concurrencies, prompt_len: int, new_tokens: int, waves: int = 3) -> list[dict]:
    """The workload of ``k3serve bench serve --range-ratio 0 --concurrency C --num-prompts waves*C``
    on the engine alone (a server's defaults: 1M context, 256 sequences): at most C requests in
    flight, a queued one added as one finishes, all timed from the host as the server's stream
    sees them. Its side by side with the server says what HTTP, SSE and the engine thread cost."""
    eng = engine_48b(256, 1 << 20, "auto")
    vocab = eng.model.config.vocab_size - 300
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    rows = []
    for C in concurrencies:
        for attempt in ("warm-up", "timed"):
            queued = torch.randint(0, vocab, (waves * C, prompt_len)).tolist()
            start, first, seen, done, itl, out_tokens = {}, {}, {}, {}, [], 0
            torch.cuda.synchronize()
            counts0 = eng.scheduled_tokens()
            t0 = time.perf_counter()
            while queued or eng.has_unfinished_requests():
                while queued and len(start) - len(done) < C:
                    start[eng.add_request(queued.pop(), params)] = time.perf_counter()
                outs = eng.step()
                now = time.perf_counter()
                for out in outs:
                    n = len(out.outputs[0].delta_token_ids)
                    if not n:
                        continue
                    out_tokens += n
                    rid = out.request_id
                    if rid in seen:
                        itl.append(now - seen[rid])
                    else:
                        first[rid] = now
                    seen[rid] = now
                    if out.finished:
                        done[rid] = now
            wall = time.perf_counter() - t0
            counts = eng.scheduled_tokens()
        med = lambda v: round(1e3 * sorted(v)[len(v) // 2], 2)  # noqa: E731
        rows.append({"concurrency": C, "requests": waves * C, "prompt": prompt_len, "new": new_tokens,
                     "output_tok_s": round(out_tokens / wall, 1),
                     "ttft_median_ms": med([first[r] - start[r] for r in first]),
                     "tpot_median_ms": med([(done[r] - first[r]) / (new_tokens - 1) for r in done]),
                     "itl_median_ms": med(itl), "itl_p99_ms": round(1e3 * sorted(itl)[int(0.99 * (len(itl) - 1))], 2),
                     "duration_s": round(wall, 2), "prefill_steps": counts["prefill_steps"] - counts0["prefill_steps"]})
        print(rows[-1], flush=True)
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def engine_arrivals(running: int, arrivals: int, prompt_len: int, prefill_graphs: str = "auto",
                    every: int = 4) -> dict:
    """Continuous batching with arrivals: ``running`` requests decode while a new prompt of
    ``prompt_len`` tokens arrives every ``every`` steps (``arrivals`` of them, 8 new tokens each):
    the running requests' mean time between tokens, the new prompts' mean time to first token.
    Each arrival's step mixes the decodes with its prefill (a static step under prefill graphs)."""
    eng = engine_48b(running + arrivals, prompt_len + 256, prefill_graphs)
    vocab = eng.model.config.vocab_size - 300
    res = {}
    for attempt in ("warm-up", "timed"):
        long = [eng.add_request(torch.randint(0, vocab, (64,)).tolist(),
                                SamplingParams(max_tokens=arrivals * every + 40, temperature=0.0, ignore_eos=True))
                for _ in range(running)]
        counts, first, added = dict.fromkeys(long, 0), {}, {}

        def step():
            for out in eng.step():
                if out.request_id in counts:
                    counts[out.request_id] = len(out.outputs[0].token_ids)
                elif out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = time.perf_counter()

        while min(counts.values()) < 2:
            step()
        torch.cuda.synchronize()
        before, t0 = dict(counts), time.perf_counter()
        for s in range(arrivals * every):
            if s % every == 0:
                rid = eng.add_request(torch.randint(0, vocab, (prompt_len,)).tolist(),
                                      SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
                added[rid] = time.perf_counter()
            step()
        window = time.perf_counter() - t0
        made = sum(counts[r] - before[r] for r in long) / running
        while eng.has_unfinished_requests():
            step()
        res = {"running": running, "arrivals": arrivals, "prompt": prompt_len, "prefill_graphs": prefill_graphs,
               "itl_ms": round(window / made * 1e3, 2),
               "arrival_ttft_ms": round(sum(first[r] - added[r] for r in added) / len(added) * 1e3, 1),
               "prefill_graph_steps": eng.runner.prefill_graph_steps}
        print(attempt, res, flush=True)
    return res  # (the engine goes with this frame; main collects it)


def engine_turns(turns: int, system_len: int, user_len: int, new_tokens: int, users: int = 1, **config) -> dict:
    """Multi-turn chats: each turn sends the user's whole history (own system prompt, earlier turns
    and answers) plus ``user_len`` new tokens, so the prefix cache holds all but the new part and
    the step is a prompt on cached context (a static prefill step where the engine's context
    buckets cover the history). Several ``users`` start a few steps apart, so each next turn
    arrives while the others decode (static with ``prefill_graph_context_decodes``, the default).
    ``config``: EngineConfig fields. Mean time to first token of turns 2.., the engine's start
    (load, compile and capture) and its prefill graphs."""
    t0 = time.perf_counter()
    history_max = system_len + turns * (user_len + new_tokens) + 64
    eng = engine_48b(users + 1, max(history_max, 33280), "auto", **config)  # (a 32K server's graphs)
    start_s = time.perf_counter() - t0
    vocab = eng.model.config.vocab_size - 300
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    gap = max(1, new_tokens // users)  # steps between the users' first turns
    res = {}
    for attempt in ("warm-up", "timed"):
        histories = [torch.randint(0, vocab, (system_len,)).tolist() for _ in range(users)]
        done, first_ttfts, later_ttfts, pending = [0] * users, [], [], {}  # pending: rid -> [user, t_add, t_first]
        before, reused = eng.runner.prefill_graph_steps, eng.prefix_stats()["tokens_reused"]
        retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)

        def submit(u):
            histories[u] = histories[u] + torch.randint(0, vocab, (user_len,)).tolist()
            pending[eng.add_request(histories[u], params)] = [u, time.perf_counter(), None]

        steps = 0
        while pending or steps <= gap * (users - 1):
            if steps % gap == 0 and steps // gap < users:
                submit(steps // gap)
            steps += 1
            for out in eng.step():
                p = pending.get(out.request_id)
                if p is None:
                    continue
                if out.outputs[0].token_ids and p[2] is None:
                    p[2] = time.perf_counter()
                if out.finished:
                    u = p[0]
                    (later_ttfts if done[u] else first_ttfts).append(p[2] - p[1])
                    histories[u] = histories[u] + list(out.outputs[0].token_ids)
                    del pending[out.request_id]
                    done[u] += 1
                    if done[u] < turns:
                        submit(u)
        res = {"users": users, "turns": turns, "system": system_len, "user": user_len,
               "max_prefill_graph_context": eng.config.max_prefill_graph_context,
               "context_decodes": eng.config.prefill_graph_context_decodes, "engine_start_s": round(start_s, 1),
               "prefill_graphs": len(getattr(eng.runner.prefill_graphs, "graphs", ())),
               "ttft_ms_turn1": round(sum(first_ttfts) / len(first_ttfts) * 1e3, 1),
               "ttft_ms_turn1_each": [round(t * 1e3, 1) for t in first_ttfts],
               "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries,
               "ttft_ms_later": round(sum(later_ttfts) / len(later_ttfts) * 1e3, 1),
               "tokens_reused": eng.prefix_stats()["tokens_reused"] - reused,
               "prefill_graph_steps": eng.runner.prefill_graph_steps - before}
        print(attempt, res, flush=True)
    return res


def engine_profile(batch: int, prompt_len: int = 512, new_tokens: int = 24, top: int = 12) -> dict:
    """Where an engine decode step's wall goes beyond its graph replay: kimi-linear-48b through
    LLMEngine at ``batch``, the decode steps after the first tokens under the profiler. The GPU's
    idle gaps (> 1 us) are summed by the names around them (the host feeding the queue late, or a
    step boundary), and every kernel and copy by name, a step (the sampler and the input copies
    run outside the graph); the host's CUDA runtime calls by name, a step (a call that waits on
    the GPU there, ``cudaStreamSynchronize`` or a pageable ``cudaMemcpy``, idles the GPU after it).
    ``wall_ms_a_step``: the same steps unprofiled (the warm-up pass; engine steps, the last of which
    only reads tokens back, so ~1/steps under the GPU's step)."""
    from torch.profiler import ProfilerActivity, profile

    eng = engine_48b(batch, prompt_len + new_tokens + 64, "auto")
    for attempt in ("warm-up", "profiled"):
        for prompt, params in greedy_requests(eng, batch, prompt_len, new_tokens):
            eng.add_request(prompt, params)
        firsts = set()
        while len(firsts) < batch:
            firsts.update(o.request_id for o in eng.step() if o.outputs[0].token_ids)
        torch.cuda.synchronize()
        steps, t0 = 0, time.perf_counter()
        prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) if attempt == "profiled" \
            else contextlib.nullcontext()
        with prof:
            while eng.has_unfinished_requests():
                eng.step()
                steps += 1
            torch.cuda.synchronize()
        if attempt == "warm-up":
            wall = (time.perf_counter() - t0) / steps
    events = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
    runtime, gaps, own, reach, prev = {}, {}, {}, events[0][1], events[0][2]
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda"):
            _tally(runtime, e.name, e.time_range.end - e.time_range.start)
    for start, end, name in events:
        if start - reach > 1.0:
            _tally(gaps, f"{prev[:48]} -> {name[:48]}", start - reach)
        if end > reach:
            reach, prev = end, name
        _tally(own, name[:60], end - start)
    span = (events[-1][1] - events[0][0]) / steps
    per_step = lambda d: sorted(((k, round(n / steps, 2), round(t / steps, 1)) for k, (n, t) in d.items()),  # noqa: E731
                                key=lambda r: -r[2])[:top]
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return {"batch": batch, "steps": steps, "wall_ms_a_step": round(wall * 1e3, 3),
            "gpu_span_ms_a_step": round(span / 1e3, 3),
            "idle_us_a_step": round(sum(t for _, t in gaps.values()) / steps, 1),
            "gaps (pair, count a step, us a step)": per_step(gaps),
            "kernels (name, count a step, us a step)": per_step(own),
            "host CUDA calls (name, count a step, us a step)": per_step(runtime)}


def hf_generate(batches, prompt_len, new_tokens) -> list[dict] | str:
    """HF transformers KimiLinearForCausalLM.generate on the same shape (random weights, bf16)."""
    try:
        from transformers import KimiLinearConfig, KimiLinearForCausalLM
    except ImportError as exc:
        return f"transformers with KimiLinear not available: {exc}"
    cfg = KimiLinearConfig(layer_types=["full_attention" if (i + 1) in (4, 8, 12, 16, 20, 24, 27)
                                        else "linear_attention" for i in range(27)])
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = KimiLinearForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model = model.to_empty(device="cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "A_log" in n:
                p.copy_(torch.log(torch.empty_like(p, dtype=torch.float32).uniform_(1, 16)))
            elif "dt_bias" in n or "e_score_correction_bias" in n:
                p.zero_()
            elif "norm" in n:
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    model.eval()
    rows = []
    for B in batches:
        ids = torch.randint(0, 160000, (B, prompt_len), device="cuda")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=4, do_sample=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=1, do_sample=False)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
        ttft = t1 - t0
        dec = (t2 - t1 - ttft) / (new_tokens - 1)
        rows.append({"batch": B, "ttft_s": round(ttft, 3), "decode_ms_per_step": round(dec * 1e3, 2),
                     "decode_tok_s": round(B / dec, 1)})
        print("HF", rows[-1], flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="slice,engine,hf",
                    help="comma list of slice, engine, engine_profile, waves, arrivals, turns, turns4, hf")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--engine-batches", default="1,16,64")
    ap.add_argument("--prefill-graphs", default="auto", help="the engine's prefill_graphs mode (auto, on, off)")
    ap.add_argument("--max-model-len", type=int, default=0,
                    help="the engine part's max_model_len (0: what its requests need; 1048576: a server's default)")
    ap.add_argument("--sampling", default="", help="the engine part's sampling, SamplingParams fields "
                    "'temperature=0.7,top_p=0.95' (empty: greedy)")
    ap.add_argument("--max-num-seqs", type=int, default=0, help="the engine part's max_num_seqs (0: its largest batch)")
    ap.add_argument("--quantization", choices=["mxfp4"], default=None,
                    help="the engine parts' routed experts quantised at load (k3serve --quantization)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--set", default="", help="module constants for the whole run, 'module.CONST=value,...' "
                    "(e.g. k3serve.model.mla.VARLEN_PREFILL=True: the engine's TTFT with an opt-in path)")
    args = ap.parse_args()
    global QUANTIZATION
    QUANTIZATION = args.quantization
    logging.basicConfig(level=os.environ.get("K3SERVE_LOG", "WARNING"))  # INFO: the graphs' capture times
    if args.set:
        from bench.overrides import set_constants

        print("set", args.set, set_constants(args.set), flush=True)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parts = set(args.parts.split(","))
    res = {"device": torch.cuda.get_device_name(), "copy_TBps": copy_tbs(), "matmul_TFLOPs": matmul_tflops(),
           "capture_blockers": capture_blockers(torch.device("cuda"))}
    print(json.dumps(res), flush=True)
    if "slice" in parts:
        model = load_model(preset="k3-slice", dtype="bfloat16", device="cuda", seed=0, progress=False)
        res["slice_decode"] = slice_decode(model, ints(args.batches), ints(args.contexts), res["copy_TBps"])
        res["slice_prefill"] = slice_prefill(model, ints(args.prefill), res["matmul_TFLOPs"])
        del model
        gc.collect()
        torch.cuda.empty_cache()
    if "engine" in parts:
        res["engine_48b"] = engine_generate(ints(args.engine_batches), 512, 32, args.prefill_graphs,
                                             args.max_model_len, args.max_num_seqs,
                                             {k: float(v) if "." in v else int(v) for k, v in
                                              (kv.split("=") for kv in args.sampling.split(",") if kv)} or None)
    if "engine_profile" in parts:  # (at the engine batches; not in the default parts)
        res["engine_profile"] = [engine_profile(b) for b in ints(args.engine_batches)]
        for r in res["engine_profile"]:
            print(json.dumps(r, indent=1), flush=True)
    if "waves" in parts:  # bench serve's workload without the server (prompts of 512, 128 new, 3 waves)
        res["waves_48b"] = engine_waves(ints(args.engine_batches), 512, 128)
    if "arrivals" in parts:  # 12 decoding, a 500-token prompt every 4th step, prefill graphs on / off
        res["arrivals_48b"] = []
        for mode in ("auto", "off"):
            res["arrivals_48b"].append(engine_arrivals(12, 8, 500, mode))
            gc.collect()
            torch.cuda.empty_cache()
    # multi-turn chats, 6 turns on a 1,500-token system prompt: one user with context graphs (the
    # default) / off; four users, their next turns arriving while the others decode, with prompts on
    # context after decode rows eager / in static steps (the default; the first engine a process
    # builds reads a little slower on turn 1: RESULTS.md nineteenth session)
    variants = {"turns": [(1, {}), (1, dict(max_prefill_graph_context=0))],
                "turns4": [(4, dict(prefill_graph_context_decodes=False)), (4, {})]}
    for part, runs in variants.items():
        if part in parts:
            res[f"{part}_48b"] = []
            for users, config in runs:
                res[f"{part}_48b"].append(engine_turns(6, 1500, 200, 16, users, **config))
                gc.collect()
                torch.cuda.empty_cache()
    if "hf" in parts:
        res["hf_48b"] = hf_generate(ints(args.engine_batches), 512, 32)
    for key in ("slice_decode", "slice_prefill", "engine_48b", "waves_48b", "arrivals_48b", "turns_48b", "turns4_48b", "hf_48b"):
        if isinstance(res.get(key), list) and res[key]:
            print(f"\n### {key}\n{table(res[key])}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "e2e.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""GPU check and timing of CUDA-graph decode steps (run on the H200; not a CI test).

1. Correctness: for several decode batch sizes, the captured bucket replay vs the eager step on a
   twin pool (same bytes): logits close, every byte of a bystander sequence unchanged.
2. Timing: one decode step (inputs -> logits) eager vs graph replay at several batch sizes and
   context lengths, CUDA-event timed, median of the iterations.
3. Engine: greedy tokens with decode graphs on vs off, and off twice as a determinism control.
4. Profile: the kernels of one decode step (batch 1 and 64, context 4096) by name, count and time.

Capture needs the Triton MoE and MLA decode (the torch references sync / size on the host), so the
script sets every K3SERVE_<OP>_BACKEND to triton (ops/backend.py: MoE, MLA, KDA, norms, AttnRes, GLU).

Usage: python bench/gpu_check_graphs.py [--preset kimi-linear-48b] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("K3SERVE_BACKEND", "triton")  # every op (ops/backend.py); per-op variables still win

from k3serve.cache.pool import UnifiedPool  # noqa: E402
from k3serve.engine.decode_graphs import DecodeGraphs  # noqa: E402
from k3serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.model.batch import ForwardBatch, SeqChunk  # noqa: E402
from k3serve.model.loader import load_model  # noqa: E402
from k3serve.ops import tuned_configs  # noqa: E402

PAGE = 64


def prefill(model, pool, lens, rng):
    seqs = []
    for n in lens:
        slot = pool.alloc_slot()
        pages = [pool.alloc_page() for _ in range(-(-(n + 8) // PAGE))]
        toks = [rng.randrange(model.config.vocab_size - 300) for _ in range(n)]
        with torch.inference_mode():
            model(ForwardBatch.build([SeqChunk(toks, 0, slot, pages)], PAGE, "cuda"), pool.handles)
        seqs.append((slot, pages, toks))
    return seqs


def eager_step(model, pool, chunks):
    """One eager step as the engine runs it: logits of each sequence's last token only (until the
    sixteenth session a prefill step here took the lm_head and fp32 logits of every token: ~13 ms
    of an 8K-token step's profile that the engine never runs)."""
    with torch.inference_mode():
        batch = ForwardBatch.build(chunks, PAGE, "cuda")
        return model.compute_logits(model(batch, pool.handles)[batch.logits_indices])


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events)."""
    ms = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return statistics.median(ms)


def check(model, rng, sizes, max_batch, pool_bytes) -> list[dict]:
    """Graph replay against (a) the same step run eagerly through the same static buffers (the
    same kernels, shapes and autotuned tiles: must match exactly, or the capture baked in a stale
    value) and (b) the engine's flat eager batch, whose numerics legitimately differ (MLA's split
    count follows the block table's width, 16 pages in the graphs; tiles are tuned per row-count
    class): reported as relative error and argmax agreement only."""
    rows = []
    for n in sizes:
        pool = UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE)
        seqs = prefill(model, pool, [rng.randrange(16, 300) for _ in range(n + 1)], rng)
        chunks = [SeqChunk([rng.randrange(1000)], len(t), s, p) for s, p, t in seqs[:n]]
        twins = [UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE) for _ in range(2)]
        for twin in twins:
            twin.buffer.copy_(pool.buffer)
        eager = eager_step(model, twins[0], chunks)
        static_eager = DecodeGraphs(model, twins[1], max_batch, max_pages=16, capture=False).run(chunks).clone()
        graphs = DecodeGraphs(model, pool, max_batch, max_pages=16, capture=True)
        static = graphs.run(chunks).clone()
        slot, pages, _ = seqs[-1]
        untouched = torch.equal(pool.slot_bytes_of(slot), twins[0].slot_bytes_of(slot)) and all(
            torch.equal(pool.page_bytes_of(p), twins[0].page_bytes_of(p)) for p in pages)
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max()).item()  # noqa: E731
        rows.append({"n": n, "bucket": graphs.bucket_for(n), "vs_static_eager_max_rel_err": rel(static, static_eager),
                     "state_equal_to_static_eager": all(  # the live sequences' slots and pages
                         torch.equal(pool.slot_bytes_of(c.kda_slot), twins[1].slot_bytes_of(c.kda_slot))
                         and all(torch.equal(pool.page_bytes_of(p), twins[1].page_bytes_of(p)) for p in c.pages)
                         for c in chunks),
                     "vs_flat_eager_max_rel_err": rel(static, eager), "bystander_untouched": untouched,
                     "argmax_equal_flat": (static.argmax(-1) == eager.argmax(-1)).float().mean().item()})
        print(rows[-1], flush=True)
        del graphs, pool, twins
        torch.cuda.empty_cache()
    return rows


def launches(fn) -> tuple[object, list[tuple]]:
    """``fn()``'s result and its kernel launches in order, (name, grid, block) from the profiler's
    trace: where two steps that should compute the same bits do not, the first launch whose tile
    or grid differs (an autotuner's pick, a split count) names the kernel."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        out = fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return out, [(e["name"][:70], tuple(e["args"].get("grid", ())), tuple(e["args"].get("block", ()))) for e in kernels]


def first_differences(a: list[tuple], b: list[tuple], n: int = 8) -> list[str]:
    """Where two kernel lists (``launches``) differ, aligned by name (the steps' input handling
    differs in torch's own small kernels, left out): the first ``n`` kernels launched in one list
    and not the other, or with another grid or block."""
    import difflib

    ours = lambda launches: [x for x in launches if not x[0].startswith("void at::")]  # noqa: E731
    a, b = ours(a), ours(b)
    matcher = difflib.SequenceMatcher(None, [x[0] for x in a], [x[0] for x in b], autojunk=False)
    out = [f"#{i + k}: {a[i + k]} | {b[j + k]}" for i, j, size in matcher.get_matching_blocks()
           for k in range(size) if a[i + k] != b[j + k]]
    out += [f"#{i1}-{i2} / #{j1}-{j2}: {a[i1:i2][:2]} | {b[j1:j2][:2]}"
            for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]
    return out[:n] + [f"our kernels {len(a)} / {len(b)}"]


def prefill_graphs_check(model, rng, cases, pool_bytes, iters, **graph_kw) -> list[dict]:
    """Prefill graphs (engine/prefill_graphs.py) for steps of new prompts (``cases``: (prompt
    lengths, decode rows before them, the prompts' cached context or 0), the decode rows on
    contexts of 16-300; ``graph_kw``: PrefillGraphs' options past the defaults below): the replay against the
    same static step run eagerly (must match exactly: a mismatch is a value baked in at capture),
    against the engine's flat eager step (numerics may differ: the padding changes tile choices),
    the prompts' slots and pages equal to the static eager twin's, a bystander untouched, the
    static eager step with the step boundary's copies in the step's stream (``transfer.SIDE_STREAMS``
    off) equal to it with them on side streams; then the step's time, eager (flat) against replay
    (inputs -> logits, CUDA events). Where the same-shape flat step differs, the first launches
    whose grid or block differ from the static eager step's are printed: the MLA prefill's tiles
    are tuned per ``tq_bucket`` of the longest prompt, which in a static step is the bucket's token
    count and in the flat step the longest chunk, so where those buckets differ (the row's
    ``mla_tq_buckets``) the two steps may run other tiles (the H200's shipped ones do at 512 / 256)."""
    from k3serve.engine import transfer
    from k3serve.engine.prefill_graphs import PrefillGraphs
    from k3serve.ops.mla_prefill_triton import tq_bucket

    pool = UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE)
    bystander = prefill(model, pool, [100], rng)[0]
    t0 = time.perf_counter()
    kw = dict(max_tokens=2048, max_seqs=2, max_decodes=16, max_pages=16, timed=False) | graph_kw  # (all kept)
    graphs = PrefillGraphs(model, pool, capture=True, **kw)
    capture_s = time.perf_counter() - t0
    rows = []
    rel = lambda a, b: ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()  # noqa: E731
    for lens, decodes, context in cases:
        chunks = [SeqChunk([rng.randrange(1000)], len(t), s, p)
                  for s, p, t in prefill(model, pool, [rng.randrange(16, 300) for _ in range(decodes)], rng)]
        whole = []  # each prompt with its context as one new prompt (the one-shot reference)
        for n in lens:  # on ``context`` cached tokens (prefilled here), or new
            slot, pages = pool.alloc_slot(), [pool.alloc_page() for _ in range(-(-(n + context) // PAGE))]
            cached = [rng.randrange(1000) for _ in range(context)]
            if context:
                with torch.inference_mode():
                    model(ForwardBatch.build([SeqChunk(cached, 0, slot, pages)], PAGE, "cuda"), pool.handles)
            chunks.append(SeqChunk([rng.randrange(model.config.vocab_size - 300) for _ in range(n)], context, slot, pages))
            whole.append(SeqChunk(cached + list(chunks[-1].token_ids), 0, pool.alloc_slot(), [pool.alloc_page() for _ in pages]))
        # the static step's padding decode rows (decode rows before prompts on context pad to the
        # largest decode bucket), for the same-shape flat step: one-token sequences on spare slots
        split = graphs._split(chunks)
        pad_rows = [SeqChunk([0], len(t), s, p) for s, p, t in
                    prefill(model, pool, [1] * (split[1] - split[0] if split else 0), rng)]
        twins = [UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE) for _ in range(4)]
        for twin in twins:
            twin.buffer.copy_(pool.buffer)
        eager = eager_step(model, twins[0], chunks)
        # the flat eager step of the same shape: the prompts and a filler prompt of the padding's
        # length on a spare slot, holding as many pages as the static block table is wide (kernel
        # choices follow the token count, MLA decode's split count the table's width; the step's
        # own bits then match)
        bucket = graphs.bucket_for(sum(lens), decodes)
        pad = bucket - sum(lens)
        filler = SeqChunk([0] * pad, 0, pool.alloc_slot(), [pool.alloc_page() for _ in range(graphs.max_pages)])
        same_shape, flat_launches = launches(lambda t=twins[2]: eager_step(model, t, pad_rows + chunks + [filler]))
        same_shape = same_shape[len(pad_rows):len(pad_rows) + len(chunks)]
        static_eager, static_launches = launches(lambda t=twins[1]: PrefillGraphs(model, t, capture=False, **kw).run(chunks).clone())
        side, transfer.SIDE_STREAMS = transfer.SIDE_STREAMS, not transfer.SIDE_STREAMS
        try:
            other_copies = PrefillGraphs(model, twins[3], capture=False, **kw).run(chunks).clone()
        finally:
            transfer.SIDE_STREAMS = side
        static = graphs.run(chunks).clone()
        one_shot = eager_step(model, twins[0], whole) if context else None  # (fresh slots and pages)
        slot, pages, _ = bystander
        row = {"prompts": lens, "decodes": decodes, "context": context, "bucket": bucket,
               "mla_tq_buckets": (tq_bucket(bucket), tq_bucket(max(lens + [pad]))),  # (static, same-shape flat)
               "vs_static_eager_max_rel_err": rel(static, static_eager),
               "state_equal_to_static_eager": all(
                   torch.equal(pool.slot_bytes_of(c.kda_slot), twins[1].slot_bytes_of(c.kda_slot))
                   and all(torch.equal(pool.page_bytes_of(p), twins[1].page_bytes_of(p)) for p in c.pages)
                   for c in chunks),
               "vs_flat_eager_max_rel_err": rel(static, eager),
               "vs_same_shape_flat_eager_max_rel_err": rel(static, same_shape),
               "static_eager_side_streams_on_vs_off": rel(static_eager, other_copies),
               "state_equal_side_streams_on_vs_off": all(
                   torch.equal(twins[3].slot_bytes_of(c.kda_slot), twins[1].slot_bytes_of(c.kda_slot)) for c in chunks),
               "argmax_equal_flat": (static.argmax(-1) == eager.argmax(-1)).float().mean().item(),
               "bystander_untouched": torch.equal(pool.slot_bytes_of(slot), twins[0].slot_bytes_of(slot)) and all(
                   torch.equal(pool.page_bytes_of(p), twins[0].page_bytes_of(p)) for p in pages)}
        if row["vs_same_shape_flat_eager_max_rel_err"]:
            row["first_launch_differences"] = first_differences(static_launches, flat_launches)
        if one_shot is not None:  # chunked on context vs one shot: how far the numerics alone move the logits
            s_p, e_p = static[decodes:], eager[decodes:]  # (the prompts' rows)
            row |= {"static_vs_one_shot": rel(s_p, one_shot), "flat_eager_vs_one_shot": rel(e_p, one_shot),
                    "argmax_static_one_shot": (s_p.argmax(-1) == one_shot.argmax(-1)).float().mean().item(),
                    "argmax_flat_eager_one_shot": (e_p.argmax(-1) == one_shot.argmax(-1)).float().mean().item()}
        del twins
        row["eager_ms"] = round(timed(lambda: eager_step(model, pool, chunks), iters), 2)
        row["graph_ms"] = round(timed(lambda: graphs.run(chunks), iters), 2)
        row["capture_s"] = round(capture_s, 1)
        rows.append(row)
        print(row, flush=True)
        torch.cuda.empty_cache()
    del graphs, pool
    torch.cuda.empty_cache()
    return rows


def prefill_calibration(model, pool_bytes, **graph_kw) -> list[dict]:
    """The engine's prefill graphs (defaults but ``graph_kw``) timed as the engine times them after
    capture: each key's replay against its eager step (ms), whether it is kept, and from which
    prompt token count its steps run static (the eager time interpolated from the bucket below)."""
    from k3serve.engine.prefill_graphs import PrefillGraphs

    pool = UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE)
    graphs = PrefillGraphs(model, pool, capture=True, **(dict(max_decodes=16, max_pages=16) | graph_kw))
    rows = []
    for key, (replay, eager) in sorted(graphs.timings.items()):
        d, n, b, c = key
        below = max([x for x in graphs.buckets if x < b] or [n])
        static_from = next((t for t in range(below, b) if graphs.faster(key, t)), None)
        rows.append({"decodes": d, "prompts": n, "bucket": b, "context": c, "replay_ms": round(replay, 2),
                     "eager_ms": round(eager, 2), "kept": key in graphs.graphs, "static_from_tokens": static_from})
        print(rows[-1], flush=True)
    del graphs, pool
    torch.cuda.empty_cache()
    return rows


def new_pool(model, pool_bytes, ctx, batch):
    """A fresh pool with ``batch`` sequences' slots and pages for ``ctx`` tokens: (pool, slots, pages)."""
    max_pages = -(-(ctx + 16) // PAGE)
    pool = UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE)
    slots = [pool.alloc_slot() for _ in range(batch)]
    pages = [[pool.alloc_page() for _ in range(max_pages)] for _ in range(batch)]
    return pool, slots, pages


def captured_pool(model, pool_bytes, ctx, batch):
    """``new_pool`` and decode graphs captured over it: (pool, slots, pages, graphs)."""
    pool, slots, pages = new_pool(model, pool_bytes, ctx, batch)
    return pool, slots, pages, DecodeGraphs(model, pool, batch, len(pages[0]), capture=True)


def timing(model, rng, sizes, contexts, pool_bytes, iters) -> list[dict]:
    rows = []
    for ctx in contexts:
        pool, slots, pages, graphs = captured_pool(model, pool_bytes, ctx, max(sizes))
        for n in sizes:
            chunks = [SeqChunk([rng.randrange(1000)], ctx, slots[i], pages[i]) for i in range(n)]
            t_eager = timed(lambda: eager_step(model, pool, chunks), iters)
            t_graph = timed(lambda: graphs.run(chunks), iters)
            rows.append({"context": ctx, "batch": n, "eager_ms": round(t_eager, 3), "graph_ms": round(t_graph, 3),
                         "speedup": round(t_eager / t_graph, 2)})
            print(rows[-1], flush=True)
        del graphs, pool
        torch.cuda.empty_cache()
    return rows


def ab_timing(model, rng, variants: str, sizes, ctx, pool_bytes, iters, rounds: int = 1,
              charged: int = 0) -> list[dict]:
    """Graph-replayed decode steps under variants of module constants, in one process (one model
    load): ``variants`` "name:module.CONST=value,...;name2:..." (values Python literals; "base" with
    nothing after the colon keeps the code's own). Each variant sets its constants, forgets the
    in-memory autotuning choices (a constant that prunes configs changes the candidates; the disk
    cache is keyed by them), captures fresh graphs and times them; the constants go back after.
    ``rounds`` > 1: every variant's graphs are captured first, over one shared pool (they read and
    write it; timing does not care what they find there), then timed in ``rounds`` alternating
    passes, each figure the median of its rounds with their spread: drift over a call then hits
    every variant alike (sequential variants that could not differ differed by up to 2 % within
    one call, RESULTS.md tenth session). ``charged`` > 0 (with rounds): each variant's replays also
    go through ``charged_kernels`` (that many replays), its per-kernel charges in the row: a
    kernel's change is then read off its own line, out of the whole step's noise."""
    import functools
    import importlib

    from triton.runtime.autotuner import Autotuner

    from bench.overrides import restore, set_constants

    def forget_tuning():
        for name in ("moe_triton", "gemv_triton", "kda_decode_triton", "mla_decode_triton", "norm_triton"):
            mod = importlib.import_module(f"k3serve.ops.{name}")
            for obj in vars(mod).values():
                if isinstance(obj, Autotuner):
                    obj.cache.clear()

    rows, kept = [], []
    shared = new_pool(model, pool_bytes, ctx, max(sizes)) if rounds > 1 else None
    for spec in variants.split(";"):
        name, _, assigns = spec.partition(":")
        saved = set_constants(assigns)
        forget_tuning()
        pool, slots, pages = shared or new_pool(model, pool_bytes, ctx, max(sizes))
        try:
            graphs = DecodeGraphs(model, pool, max(sizes), len(pages[0]), capture=True)
        except Exception as e:  # (a tile past the shared memory, say: the variant is reported, the rest go on)
            restore(saved)
            print(f"variant {name.strip()} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        runs = []
        for n in sizes:
            chunks = [SeqChunk([rng.randrange(1000)], ctx, slots[i], pages[i]) for i in range(n)]
            graphs.run(chunks)
            runs.append((n, functools.partial(graphs.run, chunks)))
        restore(saved)  # (a captured graph replays without reading them)
        if rounds > 1:
            kept.append((name.strip(), assigns, runs, graphs))
            continue
        for n, run in runs:
            rows.append({"variant": name.strip(), "set": assigns, "context": ctx, "batch": n,
                         "graph_ms": round(timed(run, iters), 3)})
            print(rows[-1], flush=True)
        del graphs, pool
        torch.cuda.empty_cache()
    times: dict = {}
    for _ in range(rounds if kept else 0):
        for name, assigns, runs, _graphs in kept:
            for n, run in runs:
                times.setdefault((name, assigns, n), []).append(timed(run, iters))
    for (name, assigns, n), ts in times.items():
        rows.append({"variant": name, "set": assigns, "context": ctx, "batch": n,
                     "graph_ms": round(statistics.median(ts), 3), "spread_ms": round(max(ts) - min(ts), 3)})
        print(rows[-1], flush=True)
    for name, assigns, runs, _graphs in (kept if charged else []):
        for n, run in runs:
            got = charged_kernels(run, charged, mark="attn_res")
            row = next(r for r in rows if (r["variant"], r["set"], r["batch"]) == (name, assigns, n))
            row["charged_us"] = {r["kernel"][:40]: r["charged_us"] for r in got["by_name"][:12]}
            row["charged_pairs_us"] = {r["kernel"]: r["charged_us"] for r in got["by_pair"][:16]}
            # the AttnRes mixers' share: of the step, of the step less its longest kernel (at
            # batch 1 the LM head, which no layer holds), and of the layers' own time (the step up
            # to the final mixer, which belongs to the head; their mixers only)
            head = max(got["by_name"], key=lambda r: r["charged_us_each"])
            row["attn_res"] = {"charged_us": round(sum(r["charged_us"] for r in got["by_name"] if "attn_res" in r["kernel"]), 1),
                               "calls": sum(r["count"] for r in got["by_name"] if "attn_res" in r["kernel"]),
                               "span_us": round(got["span_ms"] * 1e3, 1), "longest": head["kernel"][:40],
                               "longest_us": head["charged_us_each"], "layers": got.get("before_last_mark")}
    del kept, shared
    torch.cuda.empty_cache()
    forget_tuning()
    return rows


def engine_match(model, rng, n_prompts) -> dict:
    """Greedy tokens with graphs off (twice: a control for run-to-run determinism) and on. On random
    dummy weights in bf16 a near-tied argmax can flip on any kernel difference, so each mode also
    reports where its first difference from the first run lies and that step's top-1 margin there."""
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(8, 200))] for _ in range(n_prompts)]
    runs, graph_steps = {}, 0
    # graphs off twice (determinism control), on; each with overlapped scheduling (the CUDA
    # default), and graphs on with plain steps ("on_plain": overlap vs not, same kernels)
    for mode, graphs, overlap in (("off", "off", "auto"), ("off_again", "off", "auto"), ("on", "on", "auto"),
                                  ("on_plain", "on", "off")):
        eng = LLMEngine(model, None, EngineConfig(cache_memory="4GiB", max_model_len=1024, decode_graphs=graphs,
                                                  prefill_graphs=graphs, max_graph_batch=32, async_scheduling=overlap))
        ids = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2))
               for p in prompts]
        done = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0]
        runs[mode] = [done[i] for i in ids]
        if mode == "on":
            graph_steps = eng.runner.graph_steps
        del eng
        torch.cuda.empty_cache()
    res = {"requests": n_prompts, "graph_steps": graph_steps}
    for mode in ("off_again", "on", "on_plain"):
        first, margins = [], []
        for a, b in zip(runs["off"], runs[mode]):
            diff = next((j for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
            first.append(diff)
            if diff is not None and a.logprobs:
                alts = sorted((lp for _, lp in a.logprobs[diff][2]), reverse=True)  # (token, logprob, top-2)
                margins.append(round(alts[0] - alts[1], 4) if len(alts) > 1 else None)
        res[mode] = {"identical": sum(d is None for d in first), "first_difference": first,
                     "margin_at_first_difference": margins}
    return res


def step_inputs(model, rng, batch: int, ctx: int, pool_bytes: int, new_tokens: int = 1):
    """A pool and ``batch`` sequences of ``new_tokens`` random tokens each (after ``ctx`` cached
    ones for decode; fresh prompts for prefill)."""
    pool = UnifiedPool(model.config, pool_bytes, model.dtype, "cuda", PAGE)
    max_pages = -(-(ctx + new_tokens + 16) // PAGE)
    start = ctx if new_tokens == 1 else 0
    chunks = [SeqChunk([rng.randrange(model.config.vocab_size - 300) for _ in range(new_tokens)], start,
                       pool.alloc_slot(), [pool.alloc_page() for _ in range(max_pages)])
              for _ in range(batch)]
    return pool, chunks


def host_profile(model, rng, batch: int, new_tokens: int, pool_bytes: int, top: int = 30) -> str:
    """Where an eager prefill step's host time goes (cProfile over three steps, by own and by
    cumulative time): a short prompt's step is host-bound (kimi-linear-48b, 512 tokens: 33 ms of
    kernels in a 120 ms step; RESULTS.md fifteenth session)."""
    import cProfile
    import io
    import pstats

    pool, chunks = step_inputs(model, rng, batch, 0, pool_bytes, new_tokens)
    eager_step(model, pool, chunks)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        eager_step(model, pool, chunks)
        torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
    del pool
    torch.cuda.empty_cache()
    return out.getvalue()


def op_sources(model, rng, batch: int, new_tokens: int, pool_bytes: int, top: int = 30) -> list[dict]:
    """Which line of ours launches the torch ops of an eager prefill step: the profiler's aten ops
    (with Python stacks) grouped by name and innermost k3serve frame, their own GPU time and count.
    The kernel table names copy / index / fill kernels, not who asked for them."""
    from torch.profiler import ProfilerActivity, profile

    from bench.op_sources import ops_by_source

    pool, chunks = step_inputs(model, rng, batch, 0, pool_bytes, new_tokens)
    eager_step(model, pool, chunks)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        eager_step(model, pool, chunks)
        torch.cuda.synchronize()
    rows = ops_by_source(prof.events(), "self_device_time_total")
    del pool
    torch.cuda.empty_cache()
    return rows[:top]


def prefill_ab(model, seed: int, variants: str, pool_bytes: int, rounds: int = 2) -> list[dict]:
    """Eager prefill steps (1 x 512, 16 x 512 and 1 x 8,192 tokens) under variants of module
    constants (as ``ab_timing``'s ``variants``), in alternating rounds: kernels launched, kernel
    time and the step's wall time (host-bound steps show their launches' host cost there). Every
    variant and round gets the same prompts of a shape (from ``seed``): a MoE's time follows its
    routing, which the prompts decide (until the forty-second session each run drew new prompts, so a
    variant's difference mixed with its prompts': RESULTS.md, that session's 1 x 512 step)."""
    from bench.overrides import restore, set_constants

    rows = []
    for r in range(rounds):
        for spec in variants.split(";"):
            name, _, assigns = spec.partition(":")
            saved = set_constants(assigns)
            for b, n in ((1, 512), (16, 512), (1, 8192)):
                prof = kernel_profile(model, random.Random(seed + n * b), b, 0, pool_bytes, new_tokens=n)
                rows.append({"variant": name.strip(), "round": r, "tokens": f"{b} x {n}", "kernels": prof["kernels"],
                             "kernel_ms": prof["kernel_ms"], "wall_ms": prof["wall_ms"]})
                print(rows[-1], flush=True)
            restore(saved)
    return rows


def kernel_profile(model, rng, batch: int, ctx: int, pool_bytes: int, top: int = 25, new_tokens: int = 1) -> dict:
    """Where a step's GPU time goes: the eager step (for decode, the same kernels a graph
    replays) under the profiler, kernels grouped by name. The sum of kernel time vs the graph
    step's wall time says how much is launch gaps; the count is the number of graph nodes.
    ``new_tokens`` > 1: a prefill step instead, ``batch`` fresh prompts of that many tokens."""
    from torch.profiler import ProfilerActivity, profile

    pool, chunks = step_inputs(model, rng, batch, ctx, pool_bytes, new_tokens)
    eager_step(model, pool, chunks)
    torch.cuda.synchronize()
    walls = []
    for _ in range(3):  # the eager step's wall time: past the kernel time, host (launch) time
        t0 = time.perf_counter()
        eager_step(model, pool, chunks)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eager_step(model, pool, chunks)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(e.name[:90], []).append(e.device_time_total / 1e3)
    rows = sorted(({"kernel": k, "count": len(v), "ms": round(sum(v), 4)} for k, v in kernels.items()),
                  key=lambda r: -r["ms"])
    del pool
    torch.cuda.empty_cache()
    total = sum(r["ms"] for r in rows)
    families: dict[str, float] = {}
    for r in rows:
        fam = next((f for f, keys in FAMILIES if any(k in r["kernel"].lower() for k in keys)), "other")
        families[fam] = families.get(fam, 0.0) + r["ms"]
    return {"batch": batch, "context": ctx, "new_tokens": new_tokens, "kernels": sum(r["count"] for r in rows),
            "kernel_ms": round(total, 3), "wall_ms": round(1e3 * sorted(walls)[1], 3),
            "share": {f: f"{100 * ms / total:.1f} %" for f, ms in sorted(families.items(), key=lambda x: -x[1])},
            "top": rows[:top]}


def charged_kernels(fn, reps: int = 1, show: range = range(0), mark: str = "") -> dict:
    """``bench.charge.charge`` of ``reps`` runs of ``fn`` (a graph replay) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    from bench.charge import charge

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    return charge([(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower()
                   and "memset" not in e.name.lower()], reps, show, mark)


def graph_timeline(model, rng, batch: int, ctx: int, pool_bytes: int, show: range = range(25, 75)) -> dict:
    """``charged_kernels`` of one graph-replayed decode step, plus the replay's timed wall."""
    pool, slots, pages, graphs = captured_pool(model, pool_bytes, ctx, batch)
    chunks = [SeqChunk([rng.randrange(1000)], ctx, slots[i], pages[i]) for i in range(batch)]
    wall = timed(lambda: graphs.run(chunks), 20)
    res = charged_kernels(lambda: graphs.run(chunks), 1, show)
    del graphs, pool
    torch.cuda.empty_cache()
    return {"batch": batch, "context": ctx, "graph_ms": round(wall, 3), **res}


# Kernel name fragments by what they serve: the share of a decode step each family takes
# ([gpu-kernels] asks the AttnRes mixers to stay under 2 % of the layer time).
FAMILIES = (("attn_res", ("attn_res",)), ("glu", ("_glu_kernel",)),
            ("moe", ("grouped_gemm", "_route", "align_by_expert", "_expert_")), ("mla", ("_mla_",)), ("kda", ("kda", "fused_recurrent", "chunk_")), ("norm", ("norm",)),
            ("dense gemm", ("gemm", "cutlass", "sm90", "nvjet", "cublas", "gemv")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="kimi-linear-48b")
    ap.add_argument("--quantization", choices=["mxfp4"], default=None, help="routed experts quantised at load")
    ap.add_argument("--pool-gib", type=float, default=12.0, help="pool of the timing runs (128 x 4096 tokens)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parts", default="check,timing,engine,profile",
                    help="comma-separated subset of check, timing, prefill_graphs, prefill_graphs_context, prefill_graphs_context_decodes, prefill_calibration, engine, profile, profile_prefill, host_prefill, op_sources, ab, timeline (at --ab-batches), "
                         "prefill_ab (eager prefill steps under --ab's variants)")
    ap.add_argument("--ab", default="base:", help="the ab part's variants: name:module.CONST=value,...;... "
                    "(or @FILE: one variant a line)")
    ap.add_argument("--ab-batches", default="1,16")
    ap.add_argument("--ab-rounds", type=int, default=1,
                    help="> 1: capture every variant first, then time them in this many alternating rounds "
                    "(prefill_ab: its alternating rounds, at least 2)")
    ap.add_argument("--ab-charged", type=int, default=0, help="> 0 (with --ab-rounds > 1): also each variant's "
                    "kernels charged on the step's critical path, over this many profiled replays")
    ap.add_argument("--ab-pool-gib", type=float, default=4.0, help="the shared pool of --ab-rounds > 1 "
                    "(kimi-linear-48b: ~40 MB of KDA state a sequence; 64 sequences of 528 tokens fit 4 GiB)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed per profile")
    ap.add_argument("--timeline-context", type=int, default=4096, help="the timeline part's context")
    ap.add_argument("--attn-res-depth", type=int, default=0, help="k3-slice: its layers played from this K3 layer "
                    "on (bench/deep_slice.py: the blocks before it stored), so its mixers read K3's deep source counts")
    ap.add_argument("--set", default="", help="module constants for the whole run, 'module.CONST=value,...' "
                    "(e.g. a prefill profile with k3serve.ops.expert_sort.SORT_KERNEL=True)")
    args = ap.parse_args()
    if args.set:
        from bench.overrides import set_constants

        print("set", args.set, set_constants(args.set), flush=True)
    if args.attn_res_depth:
        from bench import deep_slice

        deep_slice.FIRST_LAYER = args.attn_res_depth
        deep_slice.install()
    parts = set(args.parts.split(","))
    if args.ab.startswith("@"):
        args.ab = ";".join(line.strip() for line in Path(args.ab[1:]).read_text().splitlines() if line.strip())
    rng = random.Random(0)
    model = load_model(preset=args.preset, dtype="bfloat16", device="cuda", seed=0, progress=False,
                       quantization=args.quantization)
    # the shipped tiles, as the engine applies them at start: its numerics, the same in every process
    # (the autotuner's picks otherwise vary from one fresh machine to the next)
    print("shipped autotuning results", tuned_configs.apply("cuda"), flush=True)
    pool_bytes = int(args.pool_gib * 2**30)
    res = {"preset": args.preset, "device": torch.cuda.get_device_name()}
    if "check" in parts:
        res["check"] = check(model, rng, [1, 3, 17], 32, 2 << 30)
    if "timing" in parts:
        res["timing"] = timing(model, rng, [1, 8, 32, 64, 128], [512, 4096], pool_bytes, args.iters)
        print("\n| context | batch | eager ms | graph ms | speedup |\n|---|---|---|---|---|")
        for r in res["timing"]:
            print(f"| {r['context']} | {r['batch']} | {r['eager_ms']} | {r['graph_ms']} | {r['speedup']}x |")
    if "ab" in parts:
        res["ab"] = ab_timing(model, rng, args.ab, [int(b) for b in args.ab_batches.split(",")], 512,
                              int(args.ab_pool_gib * 2**30) if args.ab_rounds > 1 else pool_bytes, args.iters,
                              args.ab_rounds, args.ab_charged)
        print("\n| variant | set | batch | graph ms | spread over rounds ms |\n|---|---|---|---|---|")
        for r in res["ab"]:
            spread = r.get("spread_ms", "-")
            print(f"| {r['variant']} | {r['set'] or '-'} | {r['batch']} | {r['graph_ms']} | {spread} |")
        charged_rows = [r for r in res["ab"] if "charged_us" in r]
        if charged_rows:  # the kernels' charged us a step, variant by variant (the base's top kernels)
            for field in ("charged_us", "charged_pairs_us"):  # by kernel, then by kernel after its predecessor
                names = list(charged_rows[0][field])[:10]
                print("\n| variant | batch | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 2))
                for r in charged_rows:
                    print(f"| {r['variant']} | {r['batch']} | " + " | ".join(str(r[field].get(k, "-")) for k in names) + " |")
            print("\n| variant | batch | AttnRes calls | AttnRes charged us | step span us | longest kernel | its us | "
                  "AttnRes % of the step | % of the step less the longest | layers' mixers (calls, us) | layers' span us | "
                  "% of the layers' time |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
            for r in charged_rows:
                a, lay = r["attn_res"], r["attn_res"]["layers"] or {}
                share = f"{100 * lay['mark_us'] / lay['span_us']:.2f}" if lay.get("span_us") else "-"
                print(f"| {r['variant']} | {r['batch']} | {a['calls']:g} | {a['charged_us']} | {a['span_us']} | {a['longest']} | "
                      f"{a['longest_us']} | {100 * a['charged_us'] / a['span_us']:.2f} | "
                      f"{100 * a['charged_us'] / (a['span_us'] - a['longest_us']):.2f} | "
                      f"{lay.get('mark_calls', '-')}, {lay.get('mark_us', '-')} | {lay.get('span_us', '-')} | {share} |")
    if "prefill_graphs" in parts:
        res["prefill_graphs"] = prefill_graphs_check(
            model, rng, [([37], 0, 0), ([500], 0, 0), ([1100], 0, 0), ([300, 700], 0, 0), ([37], 4, 0), ([200], 1, 0),
                         ([500], 16, 0), ([100, 200], 8, 0)][-int(os.environ.get("PG_CASES", 8)):], 4 << 30, args.iters)
    if "prefill_graphs_context" in parts:  # prompts on cached context (max_prefill_graph_context)
        res["prefill_graphs"] = res.get("prefill_graphs", []) + prefill_graphs_check(
            model, rng, [([200], 0, 900), ([37], 0, 3000), ([300, 20], 0, 1500)], 4 << 30, args.iters,
            max_seqs=2, max_decodes=0, max_pages=80, buckets=[128, 512], max_context=4096)
    if "prefill_graphs_context_decodes" in parts:  # ... after decode rows (prefill_graph_context_decodes)
        res["prefill_graphs"] = res.get("prefill_graphs", []) + prefill_graphs_check(
            model, rng, [([200], 4, 900), ([37], 16, 3000), ([300, 20], 1, 1500)], 4 << 30, args.iters,
            max_seqs=2, max_decodes=16, max_pages=80, buckets=[128, 512], max_context=4096, context_decodes=True)
    if "prefill_calibration" in parts:  # which buckets the engine keeps (replay faster than eager launches)
        res["prefill_calibration"] = prefill_calibration(model, 4 << 30)
        print("\n" + "\n".join(" | ".join(str(v) for v in r.values()) for r in res["prefill_calibration"]))
    if res.get("prefill_graphs"):
        print("\n| prompts | decodes | context | bucket | vs static eager | state equal | vs flat eager same shape | "
              "vs flat eager | argmax equal | bystander untouched | static eager, side streams on vs off (states equal) | "
              "MLA prefill tq buckets, static / same shape | eager ms | graph ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in res["prefill_graphs"]:
            print(f"| {r['prompts']} | {r['decodes']} | {r['context']} | {r['bucket']} | {r['vs_static_eager_max_rel_err']:.2e} | "
                  f"{r['state_equal_to_static_eager']} | {r['vs_same_shape_flat_eager_max_rel_err']:.2e} | "
                  f"{r['vs_flat_eager_max_rel_err']:.2e} | {r['argmax_equal_flat']} | "
                  f"{r['bystander_untouched']} | {r['static_eager_side_streams_on_vs_off']:.2e} "
                  f"({r['state_equal_side_streams_on_vs_off']}) | {r['mla_tq_buckets'][0]} / {r['mla_tq_buckets'][1]} | "
                  f"{r['eager_ms']} | {r['graph_ms']} |")
            for d in r.get("first_launch_differences", []):
                print(f"  {r['prompts']} + {r['decodes']}: static eager | same-shape flat eager launch {d}")
    if "engine" in parts:
        res["engine"] = engine_match(model, rng, 12)
        print(json.dumps(res["engine"]))
    if "profile" in parts:
        res["profile"] = [kernel_profile(model, rng, b, 4096, pool_bytes, top=args.top) for b in (1, 64)]
    if "profile_prefill" in parts:  # the engine's default 8192-token step: 4 prompts of 2048, 1 of 8192; one of 512
        res["profile"] = res.get("profile", []) + [kernel_profile(model, rng, b, 0, pool_bytes, new_tokens=n)
                                                   for b, n in ((1, 512), (4, 2048), (1, 8192))]
    if "timeline" in parts:  # the replayed step's kernels on its critical path, at --ab-batches
        for b in (int(x) for x in args.ab_batches.split(",")):
            tl_ = graph_timeline(model, rng, b, args.timeline_context, pool_bytes)
            res.setdefault("timeline", []).append(tl_)
            print(f"\nbatch {b}, context {args.timeline_context}, graph replay {tl_['graph_ms']} ms, "
                  f"{tl_['kernels']} kernels over {tl_.get('span_ms')} ms")
            for field in ("by_name", "by_pair"):  # by kernel, then by kernel after its predecessor
                print("\n| kernel | count | charged us | own us | charged us each |\n|---|---|---|---|---|")
                for r in tl_[field][:args.top]:
                    print(f"| {r['kernel']} | {r['count']} | {r['charged_us']} | {r['own_us']} | {r['charged_us_each']} |")
            print("\n| # | kernel | start us | own us | charged us |\n|---|---|---|---|---|")
            for r in tl_["run"]:
                print(f"| {r['index']} | {r['kernel']} | {r['start_us']} | {r['own_us']} | {r['charged_us']} |")
    if "prefill_ab" in parts:
        res["prefill_ab"] = prefill_ab(model, 0, args.ab, pool_bytes, max(args.ab_rounds, 2))
        print("\n| variant | round | tokens | kernels | kernel ms | step wall ms |\n|---|---|---|---|---|---|")
        for r in res["prefill_ab"]:
            print(f"| {r['variant']} | {r['round']} | {r['tokens']} | {r['kernels']} | {r['kernel_ms']} | {r['wall_ms']} |")
    if "op_sources" in parts:  # the torch ops (copies, indexing, fills) of the 8K-token prefill step by source line
        res["op_sources"] = op_sources(model, rng, 1, 8192, pool_bytes, args.top)
        print("\n1 x 8192 prefill, aten ops with GPU time by source\n| op | source | count | ms |\n|---|---|---|---|")
        for r in res["op_sources"]:
            print(f"| {r['op']} | {r['source']} | {r['count']} | {r['ms']} |")
    if "host_prefill" in parts:  # one prompt of 512 tokens: the host's share of its eager step
        print(f"\nhost time of 3 eager prefill steps (1 x 512 tokens), cProfile:\n"
              f"{host_profile(model, rng, 1, 512, pool_bytes, args.top)}")
    for prof in res.get("profile", []):
        print(f"\nbatch {prof['batch']} x {prof['new_tokens']} new tokens, context {prof['context']}: "
              f"{prof['kernels']} kernels, {prof['kernel_ms']} ms of kernel time, eager step {prof['wall_ms']} ms; "
              f"share: {prof['share']}\n| kernel | count | ms |\n|---|---|---|")
        for r in prof["top"]:
            print(f"| {r['kernel']} | {r['count']} | {r['ms']} |")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"graphs_{args.preset}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

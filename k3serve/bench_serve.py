"""``k3serve bench serve``: load a running server the way vLLM's serving benchmark does.

Streams /v1/completions requests (token-id prompts, ignore_eos, exact output lengths) with a
concurrency cap or a Poisson request rate, and reports request / token throughput and mean,
median, p90, p99 of TTFT, TPOT, inter-token latency and end-to-end latency.

Datasets: ``random`` (independent prompts) and ``agentic`` (sessions of several turns over one
shared system prompt; each turn's prompt is the previous prompt + its answer + a new message, so
a prefix cache can skip what it already computed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import re
import statistics
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int,
                      headers: dict) -> tuple[Result, list[int]]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    res = Result(False, len(prompt))
    last = None
    out_text_chunks = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res, []
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if last is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    out_text_chunks += 1
        res.e2e = time.perf_counter() - start
        res.ok = True
    except httpx.HTTPError as exc:
        res.error = repr(exc)
    # Token ids are not streamed back here; the agentic dataset appends random ids of the same length.
    return res, [random.randrange(1000) for _ in range(res.output_len)]


def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    v = sorted(values)

    def pct(p: float) -> float:
        return v[min(len(v) - 1, int(round(p / 100 * (len(v) - 1))))]
    return {"mean": statistics.fmean(v) * 1000, "median": statistics.median(v) * 1000,
            "p90": pct(90) * 1000, "p99": pct(99) * 1000}


async def drive(args: argparse.Namespace, share: int = 0, of: int = 1, barrier=None
                ) -> tuple[list[Result], float, float, float]:
    """This client process's part of the load: requests (or sessions) i with i % of == share, at
    its part of the concurrency, on the run's one arrival schedule. Returns the results, wall
    start and end (time.time) and its CPU seconds."""
    sched = random.Random(args.seed)  # arrivals and the shared system prompt: the same in every process
    rng = random.Random(args.seed * 1009 + share)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    concurrency = args.concurrency // of + (share < args.concurrency % of)
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get(args.url + "/v1/models", headers=headers)).json()["data"][0]["id"]
        sem = asyncio.Semaphore(concurrency)

        def length(most: int) -> int:  # uniform in [most * (1 - range_ratio), most]
            return rng.randint(max(1, round(most * (1 - args.range_ratio))), most)
        results: list[Result] = []

        async def limited(prompt, max_tokens):
            async with sem:
                return await one_request(client, args.url, model, prompt, max_tokens, headers)

        async def random_request(i: int):
            if args.request_rate:
                await asyncio.sleep(arrivals[i])
            prompt = [rng.randrange(1000) for _ in range(length(args.input_len))]
            res, _ = await limited(prompt, length(args.output_len))
            results.append(res)

        async def session(i: int, system: list[int]):
            if args.request_rate:
                await asyncio.sleep(arrivals[i])
            context = list(system)
            for _ in range(args.turns):
                context += [rng.randrange(1000) for _ in range(rng.randint(20, args.input_len))]
                res, answer = await limited(list(context), length(args.output_len))
                results.append(res)
                if not res.ok:
                    return
                context += answer

        t = 0.0
        arrivals = []
        for _ in range(args.num_prompts):
            arrivals.append(t)
            if args.request_rate:
                t += sched.expovariate(args.request_rate)
        system = [sched.randrange(1000) for _ in range(args.system_len)]
        mine = range(share, args.num_prompts, of)
        if barrier is not None:
            barrier.wait()  # every client process starts its clock together
        start, cpu0 = time.time(), time.process_time()
        if args.dataset == "random":
            await asyncio.gather(*(random_request(i) for i in mine))
        else:
            await asyncio.gather(*(session(i, system) for i in mine))
        return results, start, time.time(), time.process_time() - cpu0


def _client_process(args, share, of, barrier, out) -> None:
    out.put(asyncio.run(drive(args, share, of, barrier)))


def run_processes(args: argparse.Namespace) -> dict:
    """``--client-processes`` N: the load split over N client processes (one Python process parsing
    hundreds of SSE streams can itself become the bottleneck), merged into one report."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.client_processes), ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(args, i, args.client_processes, barrier, out))
             for i in range(args.client_processes)]
    for p in procs:
        p.start()
    parts = [out.get() for _ in procs]
    for p in procs:
        p.join()
    results = [r for part in parts for r in part[0]]
    duration = max(p[2] for p in parts) - min(p[1] for p in parts)
    return report(args.dataset, results, duration, sum(p[3] for p in parts))


async def run(args: argparse.Namespace) -> dict:
    results, start, end, cpu = await drive(args)
    return report(args.dataset, results, end - start, cpu)


def report(dataset: str, results: list[Result], duration: float, client_cpu: float) -> dict:
    good = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in good)
    in_tokens = sum(r.prompt_len for r in good)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in good if r.output_len > 1]
    return {
        "dataset": dataset, "requests": len(results), "completed": len(good), "failed": len(results) - len(good),
        "input_tokens": in_tokens, "output_tokens": out_tokens, "duration_s": round(duration, 2),
        # the clients' own CPU seconds: near duration_s x processes, the client is what limits the figures
        "client_cpu_s": round(client_cpu, 2), "request_throughput": round(len(good) / duration, 3),
        "output_token_throughput": round(out_tokens / duration, 1),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 1),
        "ttft_ms": _stats([r.ttft for r in good]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in good for x in r.itl]), "e2e_ms": _stats([r.e2e for r in good]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


_ENGINE_COUNTERS = {"prefill_steps": r"^k3serve_engine_prefill_steps (\S+)",
                    "prefill_tokens": r'^k3serve_engine_scheduled_tokens\{kind="prefill"\} (\S+)',
                    "decode_tokens": r'^k3serve_engine_scheduled_tokens\{kind="decode"\} (\S+)'}


def engine_counters(args: argparse.Namespace) -> dict | None:
    """A k3serve server's step counters from its /metrics (None from another server): around a run
    they say how many steps its prompts were prefilled in, e.g. a wave's prompts split over several."""
    try:
        text = httpx.get(args.url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    found = {k: re.search(pattern, text, re.M) for k, pattern in _ENGINE_COUNTERS.items()}
    return {k: float(m.group(1)) for k, m in found.items()} if all(found.values()) else None


def format_report(rep: dict) -> str:
    lines = [f"dataset {rep['dataset']}: {rep['completed']}/{rep['requests']} completed in {rep['duration_s']} s",
             f"request throughput {rep['request_throughput']} req/s, output {rep['output_token_throughput']} tok/s, "
             f"total {rep['total_token_throughput']} tok/s (client CPU {rep['client_cpu_s']} s)",
             f"{'metric':<6} {'mean':>9} {'median':>9} {'p90':>9} {'p99':>9}  (ms)"]
    for key in ("ttft", "tpot", "itl", "e2e"):
        s = rep[f"{key}_ms"]
        lines.append(f"{key.upper():<6} {s['mean']:>9.2f} {s['median']:>9.2f} {s['p90']:>9.2f} {s['p99']:>9.2f}")
    if rep.get("server_engine"):
        s = rep["server_engine"]
        lines.append(f"server engine: {s['prefill_tokens']} prompt tokens in {s['prefill_steps']} steps, "
                     f"{s['decode_tokens']} decode tokens")
    if rep["errors"]:
        lines.append("errors: " + "; ".join(rep["errors"]))
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=["random", "agentic"], default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests (random) or sessions (agentic)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.5,
                   help="random lengths lie in [len * (1 - ratio), len]; 0: every prompt and output exactly --input-len / --output-len")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=1,
                   help="split the load over this many client processes (for hundreds of concurrent streams)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    if not 0.0 <= args.range_ratio <= 1.0:
        raise SystemExit(f"--range-ratio must lie in [0, 1], got {args.range_ratio}")
    if not 1 <= args.client_processes <= args.concurrency:
        raise SystemExit(f"--client-processes must lie in [1, --concurrency], got {args.client_processes}")
    before = engine_counters(args)
    rep = run_processes(args) if args.client_processes > 1 else asyncio.run(run(args))
    after = engine_counters(args) if before is not None else None
    if after is not None:
        rep["server_engine"] = {k: int(after[k] - before[k]) for k in after}
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0 if rep["completed"] else 1

"""Overlapped scheduling (EngineConfig.async_scheduling="on"), run on CPU where the same code path
executes synchronously: step k+1 is scheduled and launched before step k's tokens are read, the
inputs it needs from step k are copied on the device, outputs arrive a step later. It must give
exactly the tokens, stop reasons, texts and logprobs of plain steps, through chunked prefill,
preemption, prefix caching, EOS / stop-token / stop-string ends, aborts, and the fallbacks."""

import random

import pytest

from k3serve.engine.engine import PLACEHOLDER, EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=4)


def engine(model, overlap: bool, **kw):
    kw.setdefault("cache_memory", "64MiB")
    kw.setdefault("page_size", 16)
    return LLMEngine(model, None, EngineConfig(async_scheduling="on" if overlap else "off", **kw))


def run(eng, reqs, arrivals, aborts=()):
    """Add request i at step arrivals[i], abort (step, i) pairs; finals {i: CompletionOutput}."""
    finals, step, ids, seqs = {}, 0, {}, []
    order = sorted(range(len(reqs)), key=lambda i: arrivals[i])
    while order or eng.has_unfinished_requests():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            ids[i] = eng.add_request(reqs[i][0], reqs[i][1], request_id=str(i))
            seqs += eng.requests[ids[i]].seqs
        for at, i in aborts:
            if at == step and i in ids:
                eng.abort_request(ids[i])
        for out in eng.step():
            assert all(t != PLACEHOLDER for t in out.outputs[0].token_ids)
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0]
        step += 1
    for seq in seqs:  # a sequence that stopped a step into overlap drops that step's placeholder
        assert seq.finished and PLACEHOLDER not in seq.token_ids and seq.num_computed <= seq.num_tokens
    return finals


def mixed_requests(seed: int, n: int = 24):
    rng = random.Random(seed)
    shared = [rng.randrange(0, 1700) for _ in range(40)]  # a common prefix: prefix-cache hits
    reqs = []
    for i in range(n):
        tail = [rng.randrange(0, 1700) for _ in range(rng.randrange(1, 30))]
        prompt = shared + tail if i % 3 == 0 else tail
        kind = i % 4
        if kind == 0:
            p = SamplingParams(max_tokens=rng.randrange(1, 10), temperature=0.0, ignore_eos=True)
        elif kind == 1:  # seeded sampling with logprobs
            p = SamplingParams(max_tokens=rng.randrange(2, 12), temperature=0.8, top_k=40, top_p=0.9, seed=i,
                               logprobs=2, ignore_eos=True)
        elif kind == 2:  # may stop early on the "EOS" (a frequent token, set on the engine below)
            p = SamplingParams(max_tokens=rng.randrange(4, 16), temperature=0.0)
        else:
            p = SamplingParams(max_tokens=rng.randrange(4, 16), temperature=1.0, seed=1000 + i, min_tokens=2)
        reqs.append((prompt, p))
    return reqs, [rng.randrange(0, 20) for _ in range(n)]


def frequent_token(model, reqs):
    """A token the greedy requests emit often, to play EOS (early stops one step into overlap)."""
    eng = engine(model, False)
    counts = {}
    for prompt, p in reqs[:8]:
        rid = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished and out.request_id == rid:
                    for t in out.outputs[0].token_ids:
                        counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


def same(a, b):
    """Equal tokens and ends; logprobs equal up to fp32 rounding (a request shares its steps with
    different neighbours in the two runs: finishes are seen a step later with overlap, which
    shifts admissions, and batch shapes change the GEMMs' summation order)."""
    assert a.keys() == b.keys()
    for i in a:
        x, y = a[i], b[i]
        assert (x.token_ids, x.finish_reason, x.stop_reason) == (y.token_ids, y.finish_reason, y.stop_reason), i
        assert (x.logprobs is None) == (y.logprobs is None), i
        for (t1, l1, alt1), (t2, l2, alt2) in zip(x.logprobs or [], y.logprobs or []):
            assert t1 == t2 and abs(l1 - l2) < 1e-4 and [t for t, _ in alt1] == [t for t, _ in alt2], i


@pytest.mark.parametrize("graphs", ["off", "on", "prefill"])
def test_overlap_gives_the_tokens_of_plain_steps(model, graphs):
    """Chunked prefill (48-token budget), a pool small enough to preempt, prefix caching, early
    EOS stops, seeded sampling with logprobs, min_tokens; decode steps eager or through the static
    (graph) path, and with "prefill" also steps of new prompts (after decode rows, whose inputs are
    pending under overlap) through the static prefill path. Every output equals the plain run's;
    nothing leaks; overlap really happened."""
    reqs, arrivals = mixed_requests(0)
    eos = frequent_token(model, reqs)
    probe = engine(model, False)
    lay = probe.pool.layout
    kw = dict(max_num_batched_tokens=48, max_num_seqs=10, decode_graphs="off" if graphs == "off" else "on",
              cache_memory=5 * lay.slot_bytes + 9 * lay.page_bytes)
    if graphs == "prefill":
        kw.update(prefill_graphs="on", max_prefill_graph_tokens=40, max_prefill_graph_seqs=2, max_prefill_graph_decodes=4)
    plain, over = engine(model, False, **kw), engine(model, True, **kw)
    plain.eos_ids = over.eos_ids = [eos]
    a, b = run(plain, reqs, arrivals), run(over, reqs, arrivals)
    same(a, b)
    assert len(a) == len(reqs)
    assert any(o.finish_reason == "stop" and len(o.token_ids) < r[1].max_tokens for o, r in zip(
        (a[i] for i in range(len(reqs))), reqs)), "no early stop exercised"
    assert over.scheduler.num_preemptions > 0 and over.overlapped_steps > 0.5 * over.steps
    if graphs == "prefill":
        assert over.runner.prefill_graph_steps > 0 and plain.runner.prefill_graph_steps > 0
    for eng in (plain, over):
        eng.scheduler.owners.check()
        eng.prefix.clear()
        assert eng.pool.used_bytes == 0 and not eng.has_unfinished_requests()


def test_overlap_with_aborts_ends_clean(model):
    reqs, arrivals = mixed_requests(1, 30)
    rng = random.Random(2)
    aborts = [(rng.randrange(0, 30), rng.randrange(0, 30)) for _ in range(10)]
    eng = engine(model, True, max_num_batched_tokens=64, max_num_seqs=8)
    finals = run(eng, reqs, arrivals, aborts)
    aborted = {i for _, i in aborts}
    assert set(range(30)) - aborted <= set(finals)  # every request not aborted finished
    eng.scheduler.owners.check()
    eng.prefix.clear()
    assert eng.pool.used_bytes == 0 and not eng.requests and not eng.scheduler.running


@pytest.mark.parametrize("end", ["max_tokens", "max_model_len"])
def test_a_request_ending_by_length_runs_no_extra_step(model, end):
    """A request whose last token is on the way when the next step is scheduled (its end by
    max_tokens or max_model_len is known in advance) is held back from that step: overlap runs
    exactly the decode rows plain steps run, not one more a request (a whole wasted step at batch 1),
    while the earlier tokens of the same requests are still read back a step late."""
    rng = random.Random(7)
    if end == "max_tokens":
        reqs = [([rng.randrange(1700) for _ in range(rng.randrange(3, 20))],
                 SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)) for m in (1, 2, 3, 9, 14)]
        kw = {}
    else:
        reqs = [([rng.randrange(1700) for _ in range(n)], SamplingParams(temperature=0.0, ignore_eos=True))
                for n in (20, 27, 31)]
        kw = dict(max_model_len=32)
    arrivals = [0, 0, 2, 5, 5][:len(reqs)]
    for graphs in ("off", "on"):
        plain, over = (engine(model, o, decode_graphs=graphs, max_num_seqs=4, **kw) for o in (False, True))
        same(run(plain, reqs, arrivals), run(over, reqs, arrivals))
        assert over.runner.scheduled_tokens == plain.runner.scheduled_tokens, graphs
        assert over.overlapped_steps > 0


@pytest.mark.parametrize("static", [False, True])
def test_penalties_grammars_and_n_fall_back_to_plain_steps(model, static):
    """A request whose sampling reads the token history (penalties) or an n > 1 request before
    its samples fork turns overlap off while it runs; results equal plain steps (also with
    static decode and prefill steps: the forks' and the penalties' rows come out of them)."""
    reqs, arrivals = mixed_requests(3, 12)
    reqs[2] = (reqs[2][0], SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3,
                                          frequency_penalty=0.5, ignore_eos=True))
    reqs[5] = (reqs[5][0], SamplingParams(max_tokens=6, temperature=0.7, n=2, seed=9, ignore_eos=True))
    kw = dict(decode_graphs="on", prefill_graphs="on", max_prefill_graph_tokens=40, max_prefill_graph_decodes=4) \
        if static else {}
    a = run(engine(model, False), reqs, arrivals)
    over = engine(model, True, **kw)
    b = run(over, reqs, arrivals)
    same(a, b)
    assert 0 < over.overlapped_steps < over.steps
    if static:
        assert over.runner.prefill_graph_steps > 0 and over.runner.graph_steps > 0


def test_stop_strings_and_text_with_overlap(tmp_path_factory):
    from k3serve.engine.engine import LLM
    from k3serve.make_model import make_model

    path = tmp_path_factory.mktemp("tiny_text_overlap")
    make_model("tiny", path, seed=4, progress=False)
    llms = [LLM(path, dtype="float32", device="cpu", cache_memory="64MiB", page_size=16, progress=False,
                async_scheduling=mode) for mode in ("off", "on")]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
    text = llms[0].generate(["def main():"], params, use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, skip_special_tokens=True, stop=[stop])
    outs = [llm.generate(["def main():", "class A:"], params, use_tqdm=False) for llm in llms]
    for x, y in zip(*outs):
        assert (x.outputs[0].text, x.outputs[0].finish_reason, x.outputs[0].stop_reason) == (
            y.outputs[0].text, y.outputs[0].finish_reason, y.outputs[0].stop_reason)
    assert outs[1][0].outputs[0].text == text[: text.index(stop)]

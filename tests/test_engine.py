"""Continuous batching end to end on the tiny model (fp32, CPU): batched == alone, preemption,
aborts, n > 1 by state copy, rejection, streaming."""

import random

import pytest
import torch

from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.engine.scheduler import RequestRejected
from k3serve.model.loader import load_model

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=4)


def engine(model, **kw):
    kw.setdefault("cache_memory", "64MiB")
    kw.setdefault("page_size", 16)
    return LLMEngine(model, None, EngineConfig(**kw))


def assert_no_leak(eng):
    """Nothing but cached checkpoints holds memory; dropping the cache empties the pool."""
    eng.scheduler.owners.check()
    if eng.prefix is not None:
        eng.prefix.clear()
    eng.scheduler.owners.check()
    assert eng.pool.used_bytes == 0 and eng.pool.num_slots == 0 and eng.pool.num_pages == 0


def drain(eng):
    """Step until idle; {int(request id): generated token ids}."""
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0].token_ids
    return finals


def run_alone(model, prompt, params, **kw):
    return run_with(engine(model, **kw), prompt, params)


def prompts(n, seed, lo=1, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(0, 1700) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_continuous_batching_equals_alone(model):
    """32 mixed-length requests arriving at different steps, small token budget (chunked
    prefill mixed with decodes): each output equals the request run alone, token for token."""
    ps = prompts(32, 0)
    rng = random.Random(1)
    params = [SamplingParams(max_tokens=rng.randrange(1, 9), **GREEDY) for _ in ps]
    eng = engine(model, max_num_batched_tokens=48, max_num_seqs=12)
    arrivals = sorted((rng.randrange(0, 25), i) for i in range(len(ps)))
    finals, step = {}, 0
    pending = list(arrivals)
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, i = pending.pop(0)
            eng.add_request(ps[i], params[i], request_id=str(i))
        for out in eng.step():
            if out.finished:
                finals[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert len(finals) == 32
    for i, p in enumerate(ps):
        alone = run_alone(model, p, params[i]).outputs[0].token_ids
        assert finals[i] == alone, i
        assert len(alone) == params[i].max_tokens
    assert_no_leak(eng)


def test_preemption_and_resume_give_the_same_tokens(model):
    """A pool too small for all requests at once forces preemption by recompute."""
    ps = prompts(6, 2, lo=20, hi=40)
    params = SamplingParams(max_tokens=24, **GREEDY)
    probe = engine(model)
    lay = probe.pool.layout
    # three sequences are admitted, but their 64-token totals need 12 pages: growth must preempt
    eng = engine(model, cache_memory=3 * lay.slot_bytes + 8 * lay.page_bytes, max_num_seqs=6)
    for i, p in enumerate(ps):
        eng.add_request(p, params, request_id=str(i))
    finals = drain(eng)
    assert eng.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert finals[i] == run_alone(model, p, params).outputs[0].token_ids
    assert_no_leak(eng)


def test_seeded_sampling_survives_preemption(model):
    ps = prompts(5, 3, lo=20, hi=40)
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=100 + i, ignore_eos=True)
              for i in range(5)]
    lay = engine(model).pool.layout
    eng = engine(model, cache_memory=2 * lay.slot_bytes + 6 * lay.page_bytes)
    for i, p in enumerate(ps):
        eng.add_request(p, params[i], request_id=str(i))
    finals = drain(eng)
    assert eng.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert finals[i] == run_alone(model, p, params[i]).outputs[0].token_ids


def test_n_samples_share_the_prompt_by_copy(model):
    p = prompts(1, 4, lo=40, hi=41)[0]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    eng = engine(model)
    eng.add_request(p, params)
    computed = 0
    final = None
    while eng.has_unfinished_requests():
        sched_tokens = []
        orig = eng.runner.execute

        def spy(sched, *rest):
            sched_tokens.extend(s.num_tokens for s in sched)
            return orig(sched, *rest)
        eng.runner.execute = spy
        for out in eng.step():
            final = out
        eng.runner.execute = orig
        computed += sum(sched_tokens)
    # the prompt was prefilled once; every sample then decodes its own tokens (5 each after the first)
    assert computed == len(p) + 3 * 5
    samples = [o.token_ids for o in final.outputs]
    assert len({tuple(s) for s in samples}) > 1
    for i, s in enumerate(samples):  # sample i == a single request seeded seed + i
        alone = run_alone(model, p, SamplingParams(max_tokens=6, temperature=1.0, seed=7 + i, ignore_eos=True))
        assert s == alone.outputs[0].token_ids


def test_random_requests_and_aborts_leak_nothing(model):
    rng = random.Random(5)
    lay = engine(model).pool.layout
    eng = engine(model, cache_memory=6 * lay.slot_bytes + 16 * lay.page_bytes, max_num_seqs=16,
                 max_num_batched_tokens=64)
    live: list[str] = []
    added = 0
    while added < 1000 or eng.has_unfinished_requests():
        for _ in range(rng.randrange(0, 40)):
            if added >= 1000:
                break
            p = [rng.randrange(0, 1700) for _ in range(rng.randrange(1, 30))]
            live.append(eng.add_request(p, SamplingParams(max_tokens=rng.randrange(1, 4), temperature=0.0)))
            added += 1
        for rid in rng.sample(live, k=min(len(live), rng.randrange(0, 6))):
            eng.abort_request(rid)
            live.remove(rid)
        for out in eng.step():
            if out.finished:
                live.remove(out.request_id)
    assert added == 1000
    assert_no_leak(eng)
    assert not eng.scheduler.running and not eng.scheduler.waiting and not eng.requests


def test_abort_returns_memory_at_once(model):
    eng = engine(model)
    rid = eng.add_request(prompts(1, 6, lo=50, hi=51)[0], SamplingParams(max_tokens=50, **GREEDY))
    eng.step()
    eng.step()
    seq = eng.requests[rid].seqs[0]
    assert seq.kda_slot is not None and seq.pages
    eng.abort_request(rid)
    # everything still held belongs to the prefix cache (the prompt-end checkpoint), none to the request
    from k3serve.cache.prefix import Checkpoint

    assert all(isinstance(h, Checkpoint) for h in eng.scheduler.owners.slot_holder.values())
    assert all(isinstance(h, Checkpoint) for e in eng.scheduler.owners.page_holders.values() for h, _ in e)
    assert seq.kda_slot is None and not seq.pages
    assert_no_leak(eng)
    assert not eng.has_unfinished_requests()


def test_impossible_requests_are_rejected_at_once(model):
    eng = engine(model, max_model_len=64)
    with pytest.raises(RequestRejected, match="max_model_len"):
        eng.add_request(list(range(64)), SamplingParams())
    lay = eng.pool.layout
    small = engine(model, cache_memory=lay.slot_bytes + 2 * lay.page_bytes)
    with pytest.raises(RequestRejected, match="whole cache pool"):
        small.add_request(list(range(40)), SamplingParams())
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(RequestRejected, match="token ids"):
        eng.add_request([10 ** 6], SamplingParams())
    assert not eng.has_unfinished_requests()


def test_streaming_deltas_add_up(model):
    eng = engine(model)
    rid = eng.add_request(prompts(1, 7)[0], SamplingParams(max_tokens=9, **GREEDY))
    deltas, final = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.extend(out.outputs[0].delta_token_ids)
            final = out
    assert final.finished and final.outputs[0].finish_reason == "length"
    assert deltas == final.outputs[0].token_ids and len(deltas) == 9


def test_scheduled_token_counts(model):
    """Prompt tokens in chunks of the step budget, then one decode token a step per sequence: two
    prompts of 20 and 9 tokens under a 16-token budget take 2 steps with prompt tokens, and 4
    answer tokens each take 3 decode tokens (the first comes from the prompt's last step)."""
    eng = engine(model, max_num_batched_tokens=16)
    for i, p in enumerate((prompts(1, 9, 20, 21)[0], prompts(1, 10, 9, 10)[0])):
        eng.add_request(p, SamplingParams(max_tokens=4, **GREEDY), request_id=str(i))
    assert [len(t) for t in drain(eng).values()] == [4, 4]
    assert eng.scheduled_tokens() == {"prefill": 29, "decode": 6, "prefill_steps": 2}
    assert eng.stats()["scheduled_tokens"] == eng.scheduled_tokens()


def test_eos_and_stop_token_ids_end_the_output(model):
    p = prompts(1, 8)[0]
    ref = run_alone(model, p, SamplingParams(max_tokens=8, **GREEDY)).outputs[0].token_ids
    marker = ref[3]
    first = ref.index(marker)
    eng = engine(model)
    eng.eos_ids = [marker]  # pretend the 4th greedy token is EOS
    got = run_with(eng, p, SamplingParams(max_tokens=8, temperature=0.0)).outputs[0]
    assert got.finish_reason == "stop" and got.token_ids == ref[: first + 1]
    # ignore_eos runs to the length limit instead
    got = run_with(eng, p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)).outputs[0]
    assert got.finish_reason == "length" and got.token_ids == ref
    # min_tokens forbids the EOS until enough tokens exist, so the output changes after position `first`
    got = run_with(eng, p, SamplingParams(max_tokens=8, temperature=0.0, min_tokens=first + 2)).outputs[0]
    assert marker not in got.token_ids[: first + 2] and got.token_ids[:first] == ref[:first]
    # stop_token_ids behave like EOS and report the token
    got = run_with(engine(model), p, SamplingParams(max_tokens=8, temperature=0.0,
                                                    stop_token_ids=[marker])).outputs[0]
    assert got.finish_reason == "stop" and got.stop_reason == marker and got.token_ids == ref[: first + 1]


def run_with(eng, prompt, params):
    """Run one request to the end on ``eng``; its final RequestOutput."""
    rid = eng.add_request(prompt, params)
    final = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                final = out
    return final


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory):
    from k3serve.engine.engine import LLM
    from k3serve.make_model import make_model

    path = tmp_path_factory.mktemp("tiny_text")
    make_model("tiny", path, seed=4, progress=False)
    return LLM(path, dtype="float32", device="cpu", cache_memory="64MiB", page_size=16, progress=False)


def test_text_prompts_and_stop_strings(text_llm):
    eng = text_llm.engine
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
    [ref] = text_llm.generate(["def main():"], params, use_tqdm=False)
    text = ref.outputs[0].text
    assert ref.prompt_token_ids == eng.tokenizer.encode("def main():")
    assert text == eng.tokenizer.decode(ref.outputs[0].token_ids, skip_special_tokens=True)
    # a stop string taken from the middle of the reference text cuts it exactly there
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop and stop in text
    cut = text.index(stop)
    rid = eng.add_request("def main():", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                        skip_special_tokens=True, stop=[stop]))
    streamed, final = "", None
    while eng.has_unfinished_requests():
        for out in eng.step():
            streamed += out.outputs[0].delta_text
            final = out.outputs[0]
    assert final.text == text[:cut] == streamed
    assert final.finish_reason == "stop" and final.stop_reason == stop
    # include_stop_str_in_output keeps it
    [inc] = text_llm.generate("def main():", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                            skip_special_tokens=True, stop=[stop],
                                                            include_stop_str_in_output=True), use_tqdm=False)
    assert inc.outputs[0].text == text[:cut + len(stop)]


def test_min_tokens_holds_back_stop_strings(text_llm):
    """min_tokens: no stop of any kind before that many tokens (a stop string ended it after one)."""
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
    [ref] = text_llm.generate(["def main():"], SamplingParams(**params), use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[0]  # (completes with the first token that shows text)
    assert stop != "\ufffd"
    [early] = text_llm.generate(["def main():"], SamplingParams(**params, stop=[stop]), use_tqdm=False)
    [held] = text_llm.generate(["def main():"], SamplingParams(**params, stop=[stop], min_tokens=8), use_tqdm=False)
    assert len(early.outputs[0].token_ids) < 8 <= len(held.outputs[0].token_ids)


def test_offline_api_as_vllm_users_call_it(text_llm):
    """A refused prompt leaves none of its batch behind (they were computed by the next call);
    vLLM's prompt dicts, ``chat`` and ``get_tokenizer``; non-integer token ids and bad seeds refused."""
    eng = text_llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len"):
        text_llm.generate([[5, 6], [7, 8], [5] * (eng.max_model_len + 1)], params, use_tqdm=False)
    assert not eng.has_unfinished_requests()
    [by_dict] = text_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    [by_ids] = text_llm.generate([[5, 6, 7]], params, use_tqdm=False)
    [by_text] = text_llm.generate([{"prompt": "def f():"}], params, use_tqdm=False)
    assert by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids and by_text.outputs[0].token_ids
    assert text_llm.get_tokenizer() is eng.tokenizer
    msgs = [{"role": "user", "content": "hi"}]
    outs = text_llm.chat([msgs, msgs], params, use_tqdm=False)
    from k3serve.serve.chat import build_chat_prompt

    assert len(outs) == 2 and outs[0].prompt_token_ids == build_chat_prompt(
        eng.tokenizer, eng.model.config.model_type, msgs).token_ids
    with pytest.raises(ValueError, match="integers"):
        text_llm.generate([[1.5, 5]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="params"):
        text_llm.generate(["x"], (params,), use_tqdm=False)
    for bad in (dict(seed="a"), dict(seed=2**70), dict(temperature=float("inf")), dict(temperature="hot")):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_a_stop_tokens_text_is_output_unless_special(text_llm):
    """vLLM: "the returned output will contain the stop tokens unless they are special tokens"
    (the text of a stop_token_ids hit was dropped while its token was counted)."""
    tok = text_llm.engine.tokenizer
    params = dict(max_tokens=24, temperature=0.0, ignore_eos=True, skip_special_tokens=True)
    [ref] = text_llm.generate(["def main():"], SamplingParams(**params), use_tqdm=False)
    ids = ref.outputs[0].token_ids
    at = next(i for i, t in enumerate(ids) if i >= 3 and t not in ids[:i] and not tok.is_special(t)
              and tok.decode([t]).strip())
    [out] = text_llm.generate(["def main():"], SamplingParams(**params, stop_token_ids=[ids[at]]), use_tqdm=False)
    o = out.outputs[0]
    assert o.token_ids == ids[:at + 1] and o.finish_reason == "stop" and o.stop_reason == ids[at]
    assert o.text == tok.decode(ids[:at + 1], skip_special_tokens=True) and o.text.endswith(tok.decode([ids[at]]))
    special = next(iter(tok.all_special_ids))
    assert text_llm.engine._special(special) and not text_llm.engine._special(ids[at])


def test_logprobs_through_the_engine(text_llm):
    [out] = text_llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3,
                                                            ignore_eos=True), use_tqdm=False)
    lp = out.outputs[0].logprobs
    assert len(lp) == 4
    for (tok, logprob, alts), t in zip(lp, out.outputs[0].token_ids):
        assert tok == t and len(alts) == 3
        assert alts[0][0] == tok and abs(alts[0][1] - logprob) < 1e-6  # greedy picks the top alternative
        assert alts[0][1] >= alts[1][1] >= alts[2][1]


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_delta_outputs_add_up_to_the_cumulative_ones(text_llm, async_scheduling):
    """``step(cumulative=False)`` (what the engine process streams): text, token ids and logprobs
    of the new tokens alone, which concatenated give what the cumulative form's last output holds,
    for every sequence of n > 1, with and without overlapped scheduling."""
    def run(cumulative):
        eng = LLMEngine(text_llm.engine.model, text_llm.engine.tokenizer,
                        EngineConfig(cache_memory="64MiB", page_size=16, async_scheduling=async_scheduling))
        specs = [("def f(x):", SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True, logprobs=2)),
                 ("import os", SamplingParams(max_tokens=7, n=2, temperature=0.9, seed=5, ignore_eos=True)),
                 ([5, 6, 7], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, stop=["\n\n"]))]
        rids = [eng.add_request(p, params) for p, params in specs]
        got = {(rid, i): ["", [], []] for rid, (_, params) in zip(rids, specs) for i in range(params.n)}
        finals = {}
        while eng.has_unfinished_requests():
            for out in eng.step(cumulative=cumulative):
                for o in out.outputs:
                    acc = got[(out.request_id, o.index)]
                    assert o.delta_text == (o.text if not cumulative else o.delta_text)
                    acc[0] += o.delta_text
                    acc[1] += o.delta_token_ids
                    if not cumulative:
                        assert o.token_ids == o.delta_token_ids
                        acc[2] += o.logprobs or []
                    finals[(out.request_id, o.index)] = (o.text, list(o.token_ids), o.logprobs, o.finish_reason)
        return got, finals

    deltas, _ = run(False)
    streamed, finals = run(True)
    for key, (text, ids, lps, reason) in finals.items():
        assert reason is not None
        assert deltas[key][0] == streamed[key][0] == text and deltas[key][1] == streamed[key][1] == ids
        assert deltas[key][2] == (lps or [])
    assert any(lps for _, _, lps, _ in finals.values())  # the logprobs request was compared


def test_generation_config_defaults(tmp_path):
    """vLLM's --generation-config: a model's generation_config.json sampling fields (max_new_tokens as
    max_tokens) are what omitted settings default to; "vllm" ignores them, an override wins, and a bad
    file or value is refused at start-up, naming it."""
    import json

    from k3serve.engine.sampling_params import generation_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 3, "temperature": 0.3, "top_k": 5, "max_new_tokens": 7, "do_sample": True, "top_p": None}))
    assert generation_defaults(tmp_path) == {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    assert generation_defaults(tmp_path, "vllm") == {} and generation_defaults(None) == {}
    assert generation_defaults(None, str(tmp_path)) == generation_defaults(tmp_path)
    assert generation_defaults(tmp_path, override={"temperature": 0.0, "min_p": 0.1}) == {
        "temperature": 0.0, "top_k": 5, "max_tokens": 7, "min_p": 0.1}
    for kw, needle in ((dict(override={"temprature": 1}), "temprature not among"),
                       (dict(override={"top_p": 2.0}), "generation config: top_p must be in"),
                       (dict(source=str(tmp_path / "none")), "no generation_config.json there")):
        with pytest.raises(ValueError, match=needle):
            generation_defaults(tmp_path, **kw)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        generation_defaults(tmp_path)


def test_offline_llm_samples_with_the_models_generation_config(tmp_path):
    """LLM.generate without params uses the generation config (here: greedy, 5 tokens), as vLLM's."""
    import json

    from k3serve.engine.engine import LLM
    from k3serve.make_model import make_model

    make_model("tiny", tmp_path, seed=4, progress=False)
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0, "max_new_tokens": 5}))
    llm = LLM(tmp_path, dtype="float32", device="cpu", cache_memory="64MiB", page_size=16, progress=False)
    assert llm.get_default_sampling_params().greedy and llm.get_default_sampling_params().max_tokens == 5
    a, b = (llm.generate([[5, 6, 7]], use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert a.token_ids == b.token_ids and (len(a.token_ids) == 5 or a.finish_reason == "stop")
    plain = LLM(tmp_path, dtype="float32", device="cpu", cache_memory="64MiB", page_size=16, progress=False,
                generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    hot = LLM(tmp_path, dtype="float32", device="cpu", cache_memory="64MiB", page_size=16, progress=False,
              override_generation_config={"temperature": 0.7})
    assert hot.get_default_sampling_params().temperature == 0.7 and hot.get_default_sampling_params().max_tokens == 5


def _first_outputs(eng, reqs):
    """Request ids in the order their first token came, and their final token ids."""
    order, finals = [], {}
    for prompt, params, prio in reqs:
        eng.add_request(prompt, params, priority=prio)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.outputs[0].token_ids and out.request_id not in order:
                order.append(out.request_id)
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
    return order, finals


def test_priority_policy_admits_and_preempts_by_priority(model):
    """--scheduling-policy priority: with room for two at a time, the urgent request (priority 0,
    sent last) starts first, where FCFS starts it last; when the pool runs short the worst-ranked
    running sequence is preempted even though it was admitted first; every output equals the
    request run alone."""
    ps = prompts(4, 21, 20, 30)
    params = SamplingParams(max_tokens=6, **GREEDY)
    reqs = [(p, params, prio) for p, prio in zip(ps, (5, 5, 5, 0))]
    order, finals = _first_outputs(engine(model, max_num_seqs=2, scheduling_policy="priority"), reqs)
    assert order[0] == "req-3" and order.index("req-3") < order.index("req-1")
    fcfs_order, fcfs_finals = _first_outputs(engine(model, max_num_seqs=2), [(p, params, 0) for p in ps])
    assert fcfs_order[-1] == "req-3"
    assert finals == fcfs_finals == {f"req-{i}": run_alone(model, p, params).outputs[0].token_ids
                                     for i, p in enumerate(ps)}

    eng = engine(model, scheduling_policy="priority", max_num_batched_tokens=64)
    real = eng.scheduler.owners.can_allocate
    eng.scheduler.owners.can_allocate = lambda slots=0, pages=0: (eng.pool.num_pages + pages <= 7
                                                                   and real(slots=slots, pages=pages))
    long = SamplingParams(max_tokens=40, **GREEDY)
    low = eng.add_request(ps[0], long, request_id="0", priority=9)
    eng.step()  # (the low-priority one is admitted first)
    high = eng.add_request(ps[1], long, request_id="1", priority=1)
    seqs = {rid: eng.requests[rid].seqs[0] for rid in (low, high)}
    finals = drain(eng)
    assert seqs[low].num_preemptions > 0 and seqs[high].num_preemptions == 0
    assert finals == {i: run_alone(model, ps[i], long).outputs[0].token_ids for i in (0, 1)}


def test_priority_needs_the_priority_policy(model):
    eng = engine(model)
    with pytest.raises(RequestRejected, match="needs the priority scheduling policy"):
        eng.add_request([1, 2, 3], SamplingParams(), priority=1)
    with pytest.raises(RequestRejected, match="priority must be an integer"):
        engine(model, scheduling_policy="priority").add_request([1, 2, 3], SamplingParams(), priority=1.5)
    with pytest.raises(ValueError, match="fcfs or priority"):
        engine(model, scheduling_policy="lifo")

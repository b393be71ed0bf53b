"""Prompt logprobs (vLLM's ``prompt_logprobs``) through the engine on the tiny model (fp32, CPU):
every prompt token scored against the model's one-shot forward of the whole prompt, whatever the
chunking, the prefix cache, a preemption or graphs-mode static steps did to the prefill."""

import random

import pytest
import torch

from k3serve.engine.engine import LLM, EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.loader import load_model


@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=4)


def reference(model, prompt):
    """float64 logprobs [T, V] of the one-shot forward (row p scores token p + 1)."""
    caches = CacheHandles.allocate(model.config, 1, -(-len(prompt) // 16), 16, dtype=torch.float32)
    batch = ForwardBatch.build([SeqChunk(prompt, 0, 0, list(range(-(-len(prompt) // 16))))], 16)
    with torch.inference_mode():
        return model.compute_logits(model(batch, caches)).double().log_softmax(-1)


def check(model, prompt, scores, k):
    ref = reference(model, prompt)
    assert len(scores) == len(prompt) and scores[0] is None
    for p, (tok, lp, top, rank) in enumerate(scores[1:]):
        row = ref[p]
        assert tok == prompt[p + 1]
        assert lp == pytest.approx(row[tok].item(), abs=2e-4)
        assert rank == 1 + int((row > row[tok] + 1e-5).sum())  # (ties within rounding: none drawn here)
        want_lp, want_ids = row.topk(k)
        assert [a for a, _ in top] == want_ids.tolist()
        assert [b for _, b in top] == pytest.approx(want_lp.tolist(), abs=2e-4)


def run(eng, reqs):
    """{request id: final output}, the requests added at once."""
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[i] for i in ids]


def prompts(n, seed, lo=2, hi=90):
    rng = random.Random(seed)
    return [[rng.randrange(0, 1700) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_the_whole_prompts_forward_through_chunks(model, k):
    """Prompts split into chunks of 24 tokens (budget) alongside others' decodes; each prompt's
    scores equal the one-shot forward's, and asking for them changes no generated token."""
    eng = LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16, max_num_batched_tokens=24))
    ps = prompts(6, k)
    scored = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, prompt_logprobs=k)
    plain = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    outs = run(eng, [(p, scored if i % 2 == 0 else plain) for i, p in enumerate(ps)])
    assert not eng._scoring  # (finished requests leave the runner's check off)
    alone = run(eng, [(p, plain) for p in ps])
    for i, (p, out, ref) in enumerate(zip(ps, outs, alone)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        if i % 2:
            assert out.prompt_logprobs is None
        else:
            check(model, p, out.prompt_logprobs, k)


def test_prompt_logprobs_ignore_the_prefix_cache_and_survive_preemption(model):
    """A prompt the prefix cache holds is computed whole again when scored (a hit would skip the
    rows that score it); a scored prompt preempted mid-prefill (a pool of few pages) is scored
    once, not twice."""
    eng = LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16, max_num_batched_tokens=64,
                                              prefix_block_size=16, kda_checkpoint_interval=32))
    p = prompts(1, 7, 150, 151)[0]
    run(eng, [(p, SamplingParams(max_tokens=2))])
    hits = eng.prefix.stats.tokens_reused
    out, = run(eng, [(p + [5, 6], SamplingParams(max_tokens=2, prompt_logprobs=2))])
    assert eng.prefix.stats.tokens_reused == hits  # (computed whole)
    check(model, p + [5, 6], out.prompt_logprobs, 2)
    again, = run(eng, [(p + [5, 6], SamplingParams(max_tokens=2))])
    assert eng.prefix.stats.tokens_reused > hits  # (and cached for the next unscored one)

    small = LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16, max_num_batched_tokens=32,
                                                enable_prefix_caching=False))
    ps = prompts(4, 9, 60, 80)
    small.scheduler.owners.can_allocate = _pages_at_most(small, 9)
    outs = run(small, [(q, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, prompt_logprobs=1))
                       for q in ps])
    assert small.scheduler.num_preemptions > 0
    for q, o in zip(ps, outs):
        check(model, q, o.prompt_logprobs, 1)


def _pages_at_most(eng, limit):
    """A pool that holds ``limit`` pages at a time (so the running prompts preempt each other)."""
    real = eng.scheduler.owners.can_allocate

    def can_allocate(slots=0, pages=0):
        return eng.pool.num_pages + pages <= limit and real(slots=slots, pages=pages)
    return can_allocate


def test_prompt_logprobs_under_static_steps_and_delta_outputs(model):
    """With graphs-mode static steps on (run eagerly on CPU) the scored prompt takes an eager step;
    delta outputs carry the scores once, on the first output; n > 1 shares them."""
    eng = LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16, decode_graphs="on",
                                              prefill_graphs="on"))
    p = prompts(1, 3, 40, 41)[0]
    eng.add_request(p, SamplingParams(n=2, max_tokens=4, prompt_logprobs=0, seed=1))
    seen = []
    while eng.has_unfinished_requests():
        seen += [out.prompt_logprobs for out in eng.step(cumulative=False)]
    assert seen[0] is not None and all(s is None for s in seen[1:])
    check(model, p, seen[0], 0)
    assert eng.runner.prefill_graph_steps == 0 and eng.runner.graph_steps > 0


def test_offline_llm_returns_prompt_logprobs(model):
    llm = LLM.from_engine(LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16)))
    p = [3, 1, 4, 1, 5, 9, 2, 6]
    out, = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    check(model, p, out.prompt_logprobs, 1)
    one, = llm.generate([[7]], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    assert one.prompt_logprobs == [None]


def test_sampled_logprobs_equal_the_same_tokens_scored_as_a_prompt(model):
    """The sampler's logprobs of what it sampled (and their sum, vLLM's cumulative_logprob) equal
    the scores of those tokens once they are part of a prompt."""
    llm = LLM.from_engine(LLMEngine(model, None, EngineConfig(cache_memory="64MiB", page_size=16)))
    p = prompts(1, 5, 30, 31)[0]
    out, = llm.generate([p], SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=2, ignore_eos=True),
                        use_tqdm=False)
    o = out.outputs[0]
    assert o.cumulative_logprob == pytest.approx(sum(lp for _, lp, _ in o.logprobs), abs=1e-9)
    again, = llm.generate([p + o.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)
    scored = again.prompt_logprobs[len(p):]
    assert [t for t, *_ in scored] == o.token_ids
    assert [lp for _, lp, _, _ in scored] == pytest.approx([lp for _, lp, _ in o.logprobs], abs=2e-4)
    assert [[a for a, _ in top] for _, _, top, _ in scored] == [[a for a, _ in top] for _, _, top in o.logprobs]
    plain, = llm.generate([p], SamplingParams(max_tokens=2), use_tqdm=False)
    assert plain.outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5])
def test_prompt_logprobs_range(bad):
    with pytest.raises(ValueError, match="prompt_logprobs must be in 0..20"):
        SamplingParams(prompt_logprobs=bad)

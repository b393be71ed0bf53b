"""Prefix caching across MLA pages and KDA checkpoints: the hit rule, exactness against no-cache
runs, multi-turn counters, copy-on-write, and memory pressure."""

import random

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from k3serve.cache.prefix import Checkpoint, PrefixIndex
from k3serve.config import ModelConfig
from k3serve.engine.engine import EngineConfig, LLMEngine
from k3serve.engine.sampling_params import SamplingParams
from k3serve.model.k3 import K3ForCausalLM
from k3serve.model.loader import load_dummy, load_model
from k3serve.presets import preset_config

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# ---- the hit rule on the index ------------------------------------------------------------------

def _index_with(tokens, positions, block=512, turn_end=()):
    idx = PrefixIndex(block)
    for p in positions:
        idx.add(Checkpoint(p, p in turn_end), tokens)
    return idx


def test_seed_003_worked_example():
    toks = list(range(5000))
    idx = _index_with(toks, [1024, 2560])
    prompt = toks[:2800] + [9, 9, 9]  # 2800 tokens match, then the prompt diverges
    assert idx.match(prompt).pos == 2560
    assert _index_with(toks, []).match(prompt) is None  # no checkpoint: nothing reusable
    assert idx.match(toks[:1000] + [7]) is None  # the match (1000) is below the first checkpoint


def test_hit_is_bounded_by_the_token_match_and_leaves_one_token():
    toks = list(range(3000))
    idx = _index_with(toks, [512, 1024, 1536])
    assert idx.match(toks[:1536] + [1]).pos == 1536
    assert idx.match(toks[:1536]).pos == 1024  # at least one prompt token is always computed
    changed = toks[:1100] + [-1] + toks[1101:2000]
    assert idx.match(changed).pos == 1024  # a difference inside block 3 invalidates 1536


def test_turn_end_checkpoints_are_keyed_by_their_tail():
    toks = list(range(2000))
    idx = _index_with(toks, [512, 700], turn_end=(700,))
    assert idx.match(toks[:700] + [5, 6]).pos == 700
    assert idx.match(toks[:699] + [-5, 6]).pos == 512  # the tail differs: fall back to the aligned one
    assert idx.contains(toks, 700) and not idx.contains(toks, 701)


# ---- the engine ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=8)


def engine(model, cache=True, **kw):
    cfg = dict(cache_memory="64MiB", page_size=8, enable_prefix_caching=cache, prefix_block_size=16,
               kda_checkpoint_interval=32, max_num_batched_tokens=64)
    cfg.update(kw)
    return LLMEngine(model, None, EngineConfig(**cfg))


def run(eng, prompts, params=GREEDY):
    ids = [eng.add_request(p, params) for p in prompts]
    finals = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        eng.scheduler.owners.check()
    return [finals[i] for i in ids]


def test_multi_turn_reuses_up_to_the_previous_prompt_end(model):
    rng = random.Random(0)
    cached, plain = engine(model), engine(model, cache=False)
    prompt = [rng.randrange(1700) for _ in range(37)]
    prev_len = 0
    for turn in range(4):
        before = cached.prefix_stats()
        out_c = run(cached, [prompt])[0]
        out_p = run(plain, [prompt])[0]
        assert out_c == out_p, turn  # identical token for token
        after = cached.prefix_stats()
        reused = after["tokens_reused"] - before["tokens_reused"]
        prefilled = after["tokens_prefilled"] - before["tokens_prefilled"]
        assert reused == prev_len  # turn k+1 resumes exactly at turn k's prompt end
        assert after["lookups"] - before["lookups"] == 1 and after["hits"] - before["hits"] == int(turn > 0)
        assert prefilled == len(prompt) - prev_len
        prev_len = len(prompt)
        prompt = prompt + out_c + [rng.randrange(1700) for _ in range(rng.randrange(3, 30))]
    assert cached.prefix_stats()["hit_rate"] > 0.5


def test_outputs_count_the_prompt_tokens_read_from_the_cache(model):
    """RequestOutput.num_cached_tokens (vLLM's; the server's usage.prompt_tokens_details.cached_tokens):
    0 on a miss, the tokens a hit skipped on the next turn."""
    rng = random.Random(3)
    eng = engine(model)
    prompt = [rng.randrange(1700) for _ in range(37)]

    def final(p):
        rid = eng.add_request(p, GREEDY)
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.request_id == rid and out.finished:
                    return out
    first = final(prompt)
    before = eng.prefix_stats()["tokens_reused"]
    second = final(prompt + first.outputs[0].token_ids + [5, 6, 7])
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == len(prompt)
    assert eng.prefix_stats()["tokens_reused"] - before == len(prompt)


def test_randomized_conversations_and_shared_prefix_batches_equal_no_cache(model):
    rng = random.Random(1)
    system = [rng.randrange(1700) for _ in range(45)]
    cached, plain = engine(model), engine(model, cache=False)
    convs = [list(system) + [rng.randrange(1700) for _ in range(rng.randrange(1, 20))] for _ in range(5)]
    for _ in range(3):
        batch = [c for c in convs if rng.random() < 0.8] or convs[:1]
        outs_c = run(cached, batch)
        outs_p = run(plain, batch)
        assert outs_c == outs_p
        for c, o in zip(batch, outs_c):
            c.extend(o + [rng.randrange(1700) for _ in range(rng.randrange(1, 12))])
    st_ = cached.prefix_stats()
    assert st_["hits"] > 0 and st_["checkpoints_held"] > 0


def test_copy_on_write_branches_leave_the_checkpoint_untouched(model):
    rng = random.Random(2)
    base = [rng.randrange(1700) for _ in range(41)]  # not page- or block-aligned: partial pages
    eng = engine(model)
    run(eng, [base])
    ckpts = [c for c in eng.prefix.index.checkpoints() if c.pos == len(base)]
    assert len(ckpts) == 1
    ck = ckpts[0]
    snap = (eng.pool.slot_bytes_of(ck.kda_slot).clone(), [eng.pool.page_bytes_of(p).clone() for p in ck.pages])
    branches = [base + [rng.randrange(1700) for _ in range(rng.randrange(1, 9))] for _ in range(3)]
    outs = run(eng, branches)  # all three hit the same checkpoint in one batch
    assert eng.prefix_stats()["hits"] >= 3
    plain = engine(model, cache=False)
    assert outs == run(plain, branches)
    ck_now = next(c for c in eng.prefix.index.checkpoints() if c is ck)
    assert torch.equal(eng.pool.slot_bytes_of(ck_now.kda_slot), snap[0])
    for p, b in zip(ck_now.pages, snap[1]):
        assert torch.equal(eng.pool.page_bytes_of(p), b)


def test_long_prefill_takes_interval_checkpoints(model):
    rng = random.Random(3)
    prompt = [rng.randrange(1700) for _ in range(100)]
    eng = engine(model)
    run(eng, [prompt])
    positions = sorted(c.pos for c in eng.prefix.index.checkpoints())
    assert positions == [32, 64, 96, 100]  # every 32 tokens inside the prefill, and the prompt end
    turn_end = [c for c in eng.prefix.index.checkpoints() if c.turn_end]
    assert [c.pos for c in turn_end] == [100]
    # a different continuation after token 70 resumes from the 64-token checkpoint
    before = eng.prefix_stats()["tokens_reused"]
    run(eng, [prompt[:70] + [1, 2, 3]])
    assert eng.prefix_stats()["tokens_reused"] - before == 64


def test_eviction_makes_room_for_running_requests_before_preemption(model):
    probe = engine(model)
    lay = probe.pool.layout
    eng = engine(model, cache_memory=4 * lay.slot_bytes + 24 * lay.page_bytes)
    rng = random.Random(4)
    for _ in range(6):  # each request leaves checkpoints behind
        run(eng, [[rng.randrange(1700) for _ in range(60)]])
    assert eng.prefix_stats()["checkpoints_evicted"] > 0
    assert eng.scheduler.num_preemptions == 0
    assert eng.prefix_stats()["lookups"] == 6  # one per admitted request, however often the head retried


@pytest.fixture(scope="module")
def dense_model():
    """The tiny preset routing every token to all its experts. With top-4 of 16, fp32 GEMMs that
    round differently for different batch compositions (CPU BLAS picks its kernel by the row
    count: ~1e-7 apart) can pick a different expert where two scores nearly tie, after which the
    tokens legitimately differ (hypothesis found one: seed 831, scores 5e-7 apart; the same step
    reproduces it with the cache off). Routing over all experts is continuous, so randomised
    interleavings test the cache's bookkeeping, not the batch invariance of BLAS."""
    raw = preset_config("tiny")
    text = raw.get("text_config", raw)
    text.update(num_experts_per_token=text["num_experts"], use_grouped_topk=False, num_expert_group=1, topk_group=1)
    net = K3ForCausalLM(ModelConfig.from_dict(raw), torch.float32, "cpu")
    load_dummy(net, 8)
    net.fuse_projections()
    return net.eval()


def assert_same_or_parted_at_a_tie(plain, prompt, got, want, tol=1e-5):
    """Greedy tokens equal to the no-cache run's, or equal up to a step where the no-cache model's two
    best tokens tie within fp32 rounding: there which one wins depends on the batch's BLAS kernel,
    not on the cache (hypothesis found seed 194: logprobs -4.8612947 for both, prefill and decode of
    the same context picking different ones), and the continuations legitimately part. A
    corrupted cache diverges where one token clearly leads."""
    if got == want:
        return
    pos = next((j for j in range(min(len(got), len(want))) if got[j] != want[j]), None)
    assert pos is not None, (got, want)
    rid = plain.add_request(prompt + want[:pos], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2,
                                                                ignore_eos=True))
    final = None
    while plain.has_unfinished_requests():
        for out in plain.step():
            if out.finished and out.request_id == rid:
                final = out.outputs[0]
    top = dict(final.logprobs[0][2])
    assert got[pos] in top and want[pos] in top and abs(top[got[pos]] - top[want[pos]]) < tol, (
        f"cached run parts from the plain one at step {pos} ({got[pos]} vs {want[pos]}) where the plain model's "
        f"two best are {top}: not a tie")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0, 10 ** 6))
@example(194)  # (a greedy near-tie: see assert_same_or_parted_at_a_tie)
def test_memory_pressure_interleavings(dense_model, seed):
    """Small pool, several conversations, random aborts: no corruption (completed outputs equal
    the no-cache run), no leak (dropping the cache empties the pool)."""
    model = dense_model
    rng = random.Random(seed)
    probe = engine(model)
    lay = probe.pool.layout
    eng = engine(model, cache_memory=5 * lay.slot_bytes + 30 * lay.page_bytes, max_num_seqs=4)
    plain = engine(model, cache=False)
    convs = [[rng.randrange(1700) for _ in range(rng.randrange(5, 50))] for _ in range(4)]
    for _ in range(3):
        ids = {eng.add_request(c, GREEDY): i for i, c in enumerate(convs)}
        done = {}
        while eng.has_unfinished_requests():
            if rng.random() < 0.15:
                live = [r for r in ids if r in eng.requests]
                if live:
                    eng.abort_request(rng.choice(live))
            for out in eng.step():
                if out.finished:
                    done[ids[out.request_id]] = out.outputs[0].token_ids
            eng.scheduler.owners.check()
        for i, toks in done.items():
            assert_same_or_parted_at_a_tie(plain, convs[i], toks, run(plain, [convs[i]])[0])
            convs[i] = convs[i] + toks + [rng.randrange(1700) for _ in range(rng.randrange(1, 15))]
    eng.prefix.clear()
    eng.scheduler.owners.check()
    assert eng.pool.used_bytes == 0


def test_a_finished_prompt_hands_its_slot_over(model):
    """A request that ends right after its prefill (here max_tokens=1) gives its slot and pages to
    the turn checkpoint instead of copying them; the next turn hits it."""
    rng = random.Random(5)
    prompt = [rng.randrange(1700) for _ in range(30)]
    eng = engine(model)
    run(eng, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    st = eng.prefix_stats()
    assert st["checkpoints_handed_over"] == 1 and st["checkpoints_taken"] == 0
    assert eng.pool.num_slots == 1  # the checkpoint's, no copy was made
    follow = prompt + [1, 2, 3]
    assert run(eng, [follow])[0] == run(engine(model, cache=False), [follow])[0]
    assert eng.prefix_stats()["tokens_reused"] == 30


def test_cache_salt_keeps_tenants_apart(model):
    """vLLM's cache_salt: a prompt another salt (or no salt) cached is not a hit; the same salt's is (its
    checkpoint at 32, the interval: the one at the prompt's end would leave nothing to compute),
    and the answer is the same either way."""
    rng = random.Random(11)
    prompt = [rng.randrange(1700) for _ in range(40)]
    eng = engine(model)
    salted = lambda salt: SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)  # noqa: E731
    outs, hits = [], []
    for salt in (None, "alice", "bob", "alice", None):
        before = eng.prefix_stats()["tokens_reused"]
        outs.append(run(eng, [prompt + [7]], salted(salt))[0])
        hits.append(eng.prefix_stats()["tokens_reused"] - before)
    assert hits == [0, 0, 0, 32, 32] and all(o == outs[0] for o in outs)
    with pytest.raises(ValueError, match="cache_salt must be"):
        SamplingParams(cache_salt="")

"""The K3-only parts against an independent naive implementation written from the spec (naive_k3.py).

HF transformers has no K3, so AttnRes, SiTU, latent MoE with norm, the MLA output gate, the
full-rank KDA gate and the lower-bounded gate are checked against tests/naive_k3.py, written
from model-spec.md alone, in float64.
"""

import json

import pytest
import torch
from safetensors.torch import load_file

from k3serve.make_model import make_model
from k3serve.model.attn_res import AttnResMixer, AttnResState
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.layers import glu_activation
from k3serve.model.loader import load_model
from k3serve.ops.kda_ref import kda_gate
from k3serve.ops.moe_ref import route

from naive_k3 import naive_attn_res_mix, naive_forward, naive_kda_gate, naive_router, naive_situ_glu


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=["bf16-experts", "mxfp4-experts"])
def tiny_ckpt(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    make_model("tiny", out, seed=3, mxfp4=request.param == "mxfp4-experts", progress=False)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
    cfg = json.loads((out / "config.json").read_text())
    return out, tensors, cfg


def test_tiny_preset_exercises_every_k3_feature(tiny_ckpt):
    _, _, raw = tiny_ckpt
    t = raw["text_config"]
    assert raw["model_type"] == "kimi_k3"
    assert t["hidden_act"] == "situ" and t["mla_use_output_gate"] and t["latent_moe_use_norm"]
    assert t["linear_attn_config"]["use_full_rank_gate"] and t["linear_attn_config"]["gate_lower_bound"] == -5.0
    assert t["q_lora_rank"] and t["routed_expert_hidden_size"] and t["num_shared_experts"] >= 1
    assert -(-t["num_hidden_layers"] // t["attn_res_block_size"]) >= 2
    assert t["first_k_dense_replace"] == 1 and t["num_expert_group"] > 1


def test_full_model_matches_naive_spec_implementation(tiny_ckpt):
    path, tensors, raw = tiny_ckpt
    model = load_model(path, dtype="float32", device="cpu", progress=False)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 1700, (n,), generator=gen).tolist() for n in (9, 40)]
    caches = CacheHandles.allocate(model.config, 2, 8, 16, dtype=torch.float32)
    batch = ForwardBatch.build([SeqChunk(p, 0, i, [4 * i + j for j in range(4)]) for i, p in enumerate(prompts)], 16)
    logits = model.compute_logits(model(batch, caches))
    start = 0
    for p in prompts:
        ref = naive_forward(tensors, raw["text_config"], p)
        assert rel_err(logits[start:start + len(p)], ref) <= 1e-4
        start += len(p)


def test_situ_glu_matches_formula():
    a, b = torch.randn(64, 33) * 8, torch.randn(64, 33) * 40
    for beta, lin in ((4.0, 25.0), (1.0, None), (2.5, 3.0)):
        ours = glu_activation(a, b, "situ", beta, lin)
        assert rel_err(ours, naive_situ_glu(a.double(), b.double(), beta, lin)) < 1e-6
    # Clipping is real: with a large |b| the linear clip must bound the output.
    assert glu_activation(torch.tensor([30.0]), torch.tensor([1e4]), "situ", 4.0, 25.0).abs().item() <= 4 * 25 + 1e-3
    assert glu_activation(torch.zeros(3), torch.randn(3), "situ", 4.0, 25.0).abs().max() == 0


def test_attn_res_mix_matches_formula():
    d = 48
    mixer = AttnResMixer(d, 1e-5, torch.float32)
    mixer.proj.data.normal_()
    mixer.norm.data.uniform_(0.5, 1.5)
    for m in (1, 2, 5, 9):
        sources = [torch.randn(7, d) * (i + 1) for i in range(m)]
        ref = naive_attn_res_mix([s.double() for s in sources], mixer.proj.double(), mixer.norm.double(), 1e-5)
        assert rel_err(mixer(sources), ref) < 1e-6
    # one source is passed through exactly
    s = torch.randn(3, d)
    assert torch.equal(mixer([s]), s)


@pytest.mark.parametrize("num_layers,block", [(6, 2), (7, 3), (4, 4), (5, 1)])
def test_attn_res_serving_buffer_keeps_the_same_sources_as_the_list_form(num_layers, block):
    """Serving keeps blocks and partial in one buffer updated in place (no stack per mixer); every
    mixer must see bit for bit the sources of the list form, the partial rounded to bf16 after
    every addition as there."""
    g = torch.Generator().manual_seed(num_layers * 10 + block)
    emb = torch.randn(5, 8, generator=g).bfloat16()
    listed, buffered = (AttnResState(emb, block, num_layers, use_buffer=u) for u in (False, True))
    assert buffered.buffer is not None and listed.buffer is None
    m = None
    for i in range(num_layers):
        assert torch.equal(torch.stack(listed.token_mixer_sources(i, m)), buffered.token_mixer_sources(i, m))
        a = torch.randn(5, 8, generator=g).bfloat16()
        assert torch.equal(torch.stack(listed.channel_mixer_sources(i, a)), buffered.channel_mixer_sources(i, a))
        m = torch.randn(5, 8, generator=g).bfloat16()
    assert torch.equal(torch.stack(listed.final_sources(m)), buffered.final_sources(m))
    mixer = AttnResMixer(8, 1e-5, torch.float32)
    mixer.proj.data.normal_(generator=g)
    mixer.norm.data.uniform_(0.5, 1.5, generator=g)
    assert torch.equal(mixer(listed._sources()), mixer(buffered._sources()))


def test_attn_res_source_counts_of_k3_follow_the_spec():
    """model-spec §2.7 for K3 (93 layers, blocks of 12): 8 stored blocks, the final mix over 9 sources
    (8 blocks + the partial of layers 84..92), at most 9 anywhere, the first token mixer over the
    embedding alone; a block start's token mixer reads the blocks only, its channel mixer one more
    (the new partial). bench/kernels_small.py times the mixer at these counts."""
    from bench.kernels_small import mixer_source_counts

    counts = mixer_source_counts(93, 12)
    assert len(counts) == 2 * 93 + 1 and counts[0] == 1 and counts[-1] == 9 and max(counts) == 9
    for layer in range(93):
        token, channel = counts[2 * layer], counts[2 * layer + 1]
        n = layer // 12
        assert token == (n + 1 if layer % 12 == 0 else n + 2) and channel == n + 2, layer


@pytest.mark.parametrize("num_layers,block", [(6, 2), (7, 3), (5, 1)])
def test_attn_res_deferred_partial_updates_reach_the_mixers_unchanged(num_layers, block):
    """Serving may leave each partial update (add, or copy at a block start) to the next mixer
    (``AttnResState.take_pending`` into ``mix_and_norm``, whose Triton pass does it): every mixer's
    output and the buffer afterwards are bit for bit those of the updates done in place first (here
    through the torch path, which applies the pending update before mixing)."""
    from k3serve.model.layers import RMSNorm

    g = torch.Generator().manual_seed(num_layers * 10 + block)
    emb = torch.randn(5, 8, generator=g).bfloat16()
    eager, deferred = (AttnResState(emb, block, num_layers, use_buffer=True, defer=d) for d in (False, True))
    assert deferred.defer and not eager.defer
    mixer = AttnResMixer(8, 1e-5, torch.bfloat16)
    mixer.proj.data.normal_(generator=g)
    mixer.norm.data.uniform_(0.5, 1.5, generator=g)
    norm = RMSNorm(8, 1e-5, torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5, generator=g)

    def mixes(state, i, a, m):
        x = mixer.mix_and_norm(state.token_mixer_sources(i, m), norm, torch.bfloat16, state.take_pending())
        y = mixer.mix_and_norm(state.channel_mixer_sources(i, a), norm, torch.bfloat16, state.take_pending())
        return x, y

    m = None
    for i in range(num_layers):
        a = torch.randn(5, 8, generator=g).bfloat16()
        for got, want in zip(mixes(deferred, i, a, m), mixes(eager, i, a, m)):
            assert torch.equal(got, want)
        assert eager.take_pending() is None and deferred.pending is None
        m = torch.randn(5, 8, generator=g).bfloat16()
    final = [mixer.mix_and_norm(s.final_sources(m), None, torch.bfloat16, s.take_pending()) for s in (deferred, eager)]
    assert torch.equal(final[0], final[1]) and torch.equal(deferred.buffer, eager.buffer)


@pytest.mark.parametrize("groups,topk_group,k", [(1, 1, 4), (4, 2, 4), (8, 3, 6)])
def test_router_matches_naive(groups, topk_group, k):
    E, d = 32, 24
    x = torch.randn(50, d)
    w = torch.randn(E, d)
    bias = torch.randn(E) * 0.3
    cfg = dict(num_experts=E, num_experts_per_token=k, num_expert_group=groups, topk_group=topk_group,
               moe_renormalize=True, routed_scaling_factor=2.5, moe_router_activation_func="sigmoid",
               use_grouped_topk=True)
    ours_w, ours_ids = route(x @ w.t(), bias, k, groups, topk_group, True, 2.5)
    ref_w, ref_ids = naive_router(x.double(), w.double(), bias.double(), cfg)
    # order of the K experts is irrelevant: compare as sorted (id, weight) pairs
    o = ours_ids.sort(-1)
    r = ref_ids.sort(-1)
    assert torch.equal(o.values, r.values)
    assert rel_err(ours_w.gather(1, o.indices), ref_w.gather(1, r.indices)) < 1e-6
    # selection used the bias: without it the picks differ somewhere
    _, ids_nobias = route(x @ w.t(), None, k, groups, topk_group, True, 2.5)
    assert not torch.equal(ids_nobias.sort(-1).values, o.values)


@pytest.mark.parametrize("lower_bound", [None, -5.0, -2.0])
def test_kda_gate_forms(lower_bound):
    H, D = 3, 8
    f = torch.randn(10, H, D) * 6
    A_log, dt_bias = torch.randn(H), torch.randn(H * D)
    g = kda_gate(f, A_log, dt_bias, lower_bound)
    ref = naive_kda_gate(f.double(), A_log.double(), dt_bias.double(), lower_bound)
    assert rel_err(g, ref) < 1e-6
    assert (g <= 0).all()
    if lower_bound is not None:
        # (lower_bound, 0) in exact arithmetic; fp32 sigmoid saturates to the closed interval
        assert (g >= lower_bound).all() and g.min() < lower_bound / 2


def test_deep_slice_plays_the_slice_at_k3_depth(tiny_ckpt):
    """bench/deep_slice.py (the k3-slice's mixers timed at K3's deep source counts): from layer 84 a
    4-layer forward's mixers read what K3's layers 84-87 and its final mixer read; installed, the
    tiny model's forward runs through it (its blocks before the first layer stored)."""
    from bench import deep_slice
    from bench.kernels_small import mixer_source_counts
    from k3serve.model import k3

    assert deep_slice.source_counts(12, 4, 84) == mixer_source_counts(93, 12)[168:176] + [9]
    assert deep_slice.source_counts(12, 4, 0) == mixer_source_counts(4, 12)
    path, _, raw = tiny_ckpt
    model = load_model(path, dtype="float32", device="cpu", progress=False)
    batch = ForwardBatch.build([SeqChunk([5, 6, 7], 0, 0, [0])], 16)
    caches = CacheHandles.allocate(model.config, 1, 2, 16, dtype=torch.float32)
    seen = []
    saved = k3.AttnResState
    try:
        deep_slice.install()

        class Counting(deep_slice.DeepAttnResState):
            def _sources(self, with_partial=True):
                seen.append(len(super()._sources(with_partial)))
                return super()._sources(with_partial)
        k3.AttnResState = Counting
        with torch.inference_mode():
            out = model(batch, caches)
    finally:
        k3.AttnResState = saved
    block = raw["text_config"]["attn_res_block_size"]
    assert seen == deep_slice.source_counts(block, raw["text_config"]["num_hidden_layers"])
    assert min(seen) > -(-deep_slice.FIRST_LAYER // block) and torch.isfinite(out).all()


@pytest.mark.parametrize("defer", [False, True])
def test_block_summaries_keep_the_model_output(tiny_ckpt, monkeypatch, defer):
    """Serving few tokens, a block's first mixer summarises the stored blocks for every mixer of
    the block (``AttnResState.mix``, ``block_summary``), whose later mixers then read their summary
    row and the partial alone. Forced here at every block (the torch path, fp32 model), the partial
    updates done first or left to the mixers (defer, as served): the logits of the forward those
    of the plain mixers, each block summarised once, every row of its queries used in order (a row
    read out of order would mix with another mixer's query)."""
    from k3serve.model import attn_res, k3

    path, _, raw = tiny_ckpt
    model = load_model(path, dtype="float32", device="cpu", progress=False)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1700, (n,), generator=gen).tolist() for n in (7, 3)]
    batch = ForwardBatch.build([SeqChunk(p, 0, i, [4 * i + j for j in range(4)]) for i, p in enumerate(prompts)], 16)

    def logits():
        caches = CacheHandles.allocate(model.config, 2, 8, 16, dtype=torch.float32)
        with torch.inference_mode():
            return model.compute_logits(model(batch, caches))

    plain = logits()
    states = []

    class Summarising(AttnResState):
        def __init__(self, *args, **kw):
            super().__init__(*args, summarize=True, defer=defer, **kw)
            assert self.defer == defer
            states.append(self)

    monkeypatch.setattr(attn_res, "SUMMARY_MIN_BLOCKS", 1)
    monkeypatch.setattr(k3, "AttnResState", Summarising)
    summaries = []
    real = AttnResMixer.summarize
    monkeypatch.setattr(AttnResMixer, "summarize", lambda self, *a: summaries.append(a[1].shape[0]) or real(self, *a))
    summarised = logits()
    text = raw["text_config"]
    layers, block = text["num_hidden_layers"], text["attn_res_block_size"]
    assert summaries == [2 * min(block, layers - start) + (start + block >= layers) for start in range(0, layers, block)]
    state, = states
    assert state.summary is not None and state.summary_row == summaries[-1]  # the final mixer: the last row
    assert rel_err(summarised, plain) < 1e-5, rel_err(summarised, plain)

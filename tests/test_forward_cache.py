"""The cache handles carry state: split prefill / decode / mixed steps equal one full prefill."""

import pytest
import torch

from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.loader import load_model
from k3serve.ops import mla_ref

PAGE = 16


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture(scope="module", params=[False, True], ids=["bf16-experts", "mxfp4-experts"])
def model(request):
    return load_model(preset="tiny", dtype="float32", device="cpu", seed=1, mxfp4=request.param)


def _pages(slot):
    return list(range(slot * 8, slot * 8 + 8))


def _full_logits(model, ids):
    caches = CacheHandles.allocate(model.config, 1, 8, PAGE, dtype=torch.float32)
    return model.compute_logits(model(ForwardBatch.build([SeqChunk(ids, 0, 0, _pages(0))], PAGE), caches))


def _run_schedule(model, seqs, schedule):
    """schedule: list of steps, each a list of (seq index, number of new tokens). Returns, per
    sequence, the logits of every token it fed, in order."""
    caches = CacheHandles.allocate(model.config, len(seqs), 8 * len(seqs), PAGE, dtype=torch.float32)
    # Garbage in every slot and page: a fresh sequence must never read its slot.
    for c in caches.kda:
        c.recurrent.normal_()
        c.conv.normal_()
    for c in caches.mla:
        c.latent.normal_()
    done = [0] * len(seqs)
    out = [[] for _ in seqs]
    for step in schedule:
        step = sorted(step, key=lambda s: s[1] != 1)  # decode steps first, as the runner orders them
        chunks = [SeqChunk(seqs[i][done[i]:done[i] + n], done[i], i, _pages(i)) for i, n in step]
        batch = ForwardBatch.build(chunks, PAGE)
        logits = model.compute_logits(model(batch, caches))
        for (i, n), (s, e) in zip(step, (batch.token_range(j) for j in range(len(step)))):
            out[i].append(logits[s:e])
            done[i] += n
    return [torch.cat(o) for o in out]


def test_prefill_then_decode_equals_full_prefill(model):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1700, (45,), generator=gen).tolist()
    ref = _full_logits(model, ids)
    got = _run_schedule(model, [ids], [[(0, 37)]] + [[(0, 1)]] * 8)[0]
    assert rel_err(got, ref) <= 1e-5


def test_chunked_prefill_across_pages_then_decode(model):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1700, (70,), generator=gen).tolist()
    ref = _full_logits(model, ids)
    got = _run_schedule(model, [ids], [[(0, 5)], [(0, 17)], [(0, 1)], [(0, 40)], [(0, 1)], [(0, 1)], [(0, 5)]])[0]
    assert rel_err(got, ref) <= 1e-5


def test_mixed_steps_equal_each_sequence_alone(model):
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 1700, (n,), generator=gen).tolist() for n in (20, 33, 1, 12)]
    schedule = [
        [(0, 19), (1, 10)],
        [(0, 1), (1, 23), (2, 1), (3, 4)],  # a decode, a prefill chunk, a 1-token prompt, a prefill
        [(3, 8)],
    ]
    got = _run_schedule(model, seqs, schedule)
    for ids, g in zip(seqs, got):
        assert rel_err(g, _full_logits(model, ids)) <= 1e-5


@pytest.mark.parametrize("layer_kind", ["kda", "mla"])
def test_layer_state_handover(model, layer_kind):
    """One layer of each kind on its own: prefill N then M decodes leaves the same cache as one
    prefill of N+M and gives the same outputs."""
    idx = next(i for i, k in enumerate(model.config.is_kda) if k == (layer_kind == "kda"))
    layer = model.model.layers[idx].self_attn
    T, N = 24, 15
    x = torch.randn(T, model.config.hidden_size, generator=torch.Generator().manual_seed(3))

    def caches():
        c = CacheHandles.allocate(model.config, 1, 4, PAGE, dtype=torch.float32)
        return (c.kda[0] if layer_kind == "kda" else c.mla[0])

    full_cache = caches()
    full = layer(x, ForwardBatch.build([SeqChunk([0] * T, 0, 0, [0, 1])], PAGE), full_cache)
    split_cache = caches()
    outs = [layer(x[:N], ForwardBatch.build([SeqChunk([0] * N, 0, 0, [0, 1])], PAGE), split_cache)]
    for t in range(N, T):
        outs.append(layer(x[t:t + 1], ForwardBatch.build([SeqChunk([0], t, 0, [0, 1])], PAGE), split_cache))
    assert rel_err(torch.cat(outs), full) <= 1e-5
    if layer_kind == "kda":
        assert torch.allclose(split_cache.recurrent, full_cache.recurrent, atol=1e-5)
        assert torch.allclose(split_cache.conv, full_cache.conv, atol=1e-5)  # GEMM shape rounding only
    else:
        assert torch.allclose(split_cache.latent, full_cache.latent, atol=1e-5)


def test_mla_absorbed_equals_expanded():
    """The weight-absorbed form (decode) and the expanded form (prefill) compute the same attention,
    here on a prefill chunk with cached context, so the causal offset is exercised too."""
    gen = torch.Generator().manual_seed(4)
    Ha, dn, dr, dv, rkv = 4, 16, 8, 12, 32
    ctx, Tq = 19, 7
    q = torch.randn(Tq, Ha, dn + dr, generator=gen)
    latent = torch.randn(ctx + Tq, rkv + dr, generator=gen)
    w = torch.randn(Ha * (dn + dv), rkv, generator=gen) / rkv ** 0.5
    scale = (dn + dr) ** -0.5
    expanded = mla_ref.mla_expanded_ref(q, latent, w, ctx, rkv, dn, scale)
    mask = mla_ref.causal_mask(Tq, ctx, ctx + Tq, q.device)
    q_abs = mla_ref.absorb_query(q, w, rkv, dn)
    o_lat = mla_ref.mla_absorbed_ref(q_abs[None], latent[None], mask[None], rkv, scale)[0]
    absorbed = mla_ref.unabsorb_output(o_lat, w, rkv, dn)
    assert rel_err(absorbed, expanded) <= 1e-5
    # and the causal offset matters: without it the answers differ
    wrong = mla_ref.mla_expanded_ref(q, latent, w, 0, rkv, dn, scale)
    assert rel_err(wrong, expanded) > 1e-2


def test_strided_pool_views(model):
    """Caches handed out as strided views into one shared buffer (as the unified pool does:
    all MLA layers of a page side by side) give the same result as separate tensors."""
    cfg = model.config
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 1700, (30,), generator=gen).tolist()
    ref = _full_logits(model, ids)
    base = CacheHandles.allocate(cfg, 1, 8, PAGE, dtype=torch.float32)
    shared = torch.zeros(8, cfg.num_mla_layers, PAGE, cfg.mla_cache_width)
    base.mla = [type(base.mla[0])(shared[:, j]) for j in range(cfg.num_mla_layers)]
    assert not base.mla[0].latent.is_contiguous()
    batch = ForwardBatch.build([SeqChunk(ids[:20], 0, 0, _pages(0))], PAGE)
    first = model.compute_logits(model(batch, base))
    rest = []
    for t in range(20, 30):
        rest.append(model.compute_logits(model(ForwardBatch.build([SeqChunk([ids[t]], t, 0, _pages(0))], PAGE), base)))
    assert rel_err(torch.cat([first] + rest), ref) <= 1e-5
    assert shared.abs().sum() > 0  # the writes landed in the shared buffer


def test_prefill_cu_seqlens_built_once_a_step():
    """The non-decode sequences' token offsets (fla's ``cu_seqlens``), on the device and the host:
    one pair a step, the same objects for every KDA layer (fla memoises its chunk indices by
    argument identity: a fresh pair a layer cost a blocking copy, a stream sync, each time)."""
    chunks = [SeqChunk([5], 7, 0, [0]), SeqChunk([1, 2, 3], 0, 1, [1]), SeqChunk([4] * 70, 10, 2, [2, 3])]
    batch = ForwardBatch.build(chunks, 64, "cpu")
    dev, host = batch.prefill_cu_seqlens
    assert batch.num_decodes == 1 and host.tolist() == [0, 3, 73] and torch.equal(dev, host)
    again = batch.prefill_cu_seqlens
    assert again[0] is dev and again[1] is host


@pytest.mark.parametrize("new_tokens", [[3, 70], [64, 1, 129, 65], [200], [2, 1, 128, 63]])
def test_kda_chunk_indices_name_every_chunk_of_every_prompt(new_tokens):
    """fla's ``chunk_indices`` (prefill sequence, chunk within it), built from the host lengths
    after the step's decode rows: every 64-token chunk of every prompt, in order, and once a step."""
    from k3serve.model.batch import KDA_CHUNK

    chunks = [SeqChunk([5], 7, 0, [0]), SeqChunk([6], 9, 1, [1])]
    chunks += [SeqChunk([4] * n, 0, 2 + i, list(range(2 + 4 * i, 6 + 4 * i))) for i, n in enumerate(new_tokens)]
    batch = ForwardBatch.build(chunks, 64, "cpu")
    want = [[s, c] for s, n in enumerate(new_tokens) for c in range(-(-n // KDA_CHUNK))]
    got = batch.kda_chunk_indices
    assert got.dtype == torch.int64 and got.tolist() == want
    assert batch.kda_chunk_indices is got


def test_conv_normalising_q_and_k_gives_the_same_model(model, monkeypatch):
    """``kda.CONV_NORMS_QK``: q and k L2-normalised by the short conv instead of inside kda_core:
    the same logits over a mixed schedule (prefill chunks on cached context, decodes)."""
    from k3serve.model import kda

    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1700, (n,), generator=gen).tolist() for n in (30, 21)]
    schedule = [[(0, 12)], [(0, 1), (1, 15)], [(0, 9), (1, 1)], [(0, 1), (1, 1)]]
    monkeypatch.setattr(kda, "CONV_NORMS_QK", False)
    ref = _run_schedule(model, seqs, schedule)
    monkeypatch.setattr(kda, "CONV_NORMS_QK", True)
    got = _run_schedule(model, seqs, schedule)
    assert all(rel_err(g, r) <= 1e-5 for g, r in zip(got, ref))
    monkeypatch.setattr(kda, "CONV_NORMS_QK", False)
    assert all(torch.equal(a, b) for a, b in zip(_run_schedule(model, seqs, schedule), ref))

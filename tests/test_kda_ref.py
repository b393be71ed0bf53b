"""Chunked (UT-transform) KDA against the per-token recurrence, the definition."""

import pytest
import torch

from k3serve.ops.kda_ref import kda_chunked_ref, kda_gate, kda_recurrent_ref, l2norm


def _inputs(T, H, K, V, lower_bound, gen):
    q = l2norm(torch.randn(T, H, K, generator=gen))
    k = l2norm(torch.randn(T, H, K, generator=gen))
    v = torch.randn(T, H, V, generator=gen)
    f = torch.randn(T, H, K, generator=gen) * 3
    g = kda_gate(f, torch.rand(H, generator=gen) * 2.7, torch.randn(H * K, generator=gen), lower_bound)
    beta = torch.rand(T, H, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrence(seed, with_state):
    gen = torch.Generator().manual_seed(seed)
    T = int(torch.randint(1, 300, (1,), generator=gen))
    H = int(torch.randint(1, 5, (1,), generator=gen))
    K = int(torch.tensor([8, 16, 32])[torch.randint(0, 3, (1,), generator=gen)])
    V = int(torch.tensor([8, 16, 24])[torch.randint(0, 3, (1,), generator=gen)])
    C = int(torch.tensor([16, 32, 64])[torch.randint(0, 3, (1,), generator=gen)])
    lower_bound = -5.0 if seed % 2 else None
    q, k, v, g, beta = _inputs(T, H, K, V, lower_bound, gen)
    s0 = torch.randn(H, K, V, generator=gen) if with_state else None
    o_ref, s_ref = kda_recurrent_ref(q[None], k[None], v[None], g[None], beta[None], K ** -0.5,
                                     None if s0 is None else s0[None])
    o, s = kda_chunked_ref(q, k, v, g, beta, K ** -0.5, s0, chunk_size=C)
    assert (o - o_ref[0]).abs().max() <= 1e-5 * max(1.0, o_ref.abs().max().item())
    assert (s - s_ref[0]).abs().max() <= 1e-5 * max(1.0, s_ref.abs().max().item())


def test_strong_decay_over_long_chunk_stays_finite():
    """K3's bound lets g reach -5 per token: 64 tokens give a cumulative -320, which overflows any
    exp(G_i) * exp(-G_j) factorisation in fp32. The per-pair form must stay exact."""
    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 128, 2, 16, 16
    q, k, v, _, beta = _inputs(T, H, K, V, -5.0, gen)
    g = torch.full((T, H, K), -4.99)
    o_ref, s_ref = kda_recurrent_ref(q[None], k[None], v[None], g[None], beta[None], K ** -0.5)
    o, s = kda_chunked_ref(q, k, v, g, beta, K ** -0.5, chunk_size=64)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert (o - o_ref[0]).abs().max() <= 1e-5


def test_state_carries_across_splits():
    """Two chunked calls with the state handed over equal one call over the whole sequence."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, g, beta = _inputs(150, 3, 16, 8, -5.0, gen)
    o_all, s_all = kda_chunked_ref(q, k, v, g, beta, 0.25)
    o1, s1 = kda_chunked_ref(q[:70], k[:70], v[:70], g[:70], beta[:70], 0.25)
    o2, s2 = kda_chunked_ref(q[70:], k[70:], v[70:], g[70:], beta[70:], 0.25, s1)
    assert torch.allclose(torch.cat([o1, o2]), o_all, atol=1e-5)
    assert torch.allclose(s2, s_all, atol=1e-5)


def test_l2norm_eps_inside_sqrt():
    x = torch.tensor([[3e-4, 4e-4]])
    assert torch.allclose(l2norm(x), x / torch.sqrt(torch.tensor(25e-8 + 1e-6)))


def test_factorised_pairwise_decay_equals_the_exact_form():
    """The one-matmul factorisation around the chunk middle matches the [H, C, C, K] pairwise form
    on the lower triangle (the only part the UT transform uses)."""
    from k3serve.ops.kda_ref import _pairwise

    gen = torch.Generator().manual_seed(11)
    for C, depth in ((16, 5.0), (32, 2.5), (64, 1.2)):  # within-chunk spans up to about 80
        a, b = torch.randn(3, C, 8, generator=gen), torch.randn(3, C, 8, generator=gen)
        G = (-depth * torch.rand(3, C, 8, generator=gen)).cumsum(1)
        tril = torch.tril(torch.ones(C, C, dtype=torch.bool))
        exact = _pairwise(a, b, G, factorised=False)
        fact = _pairwise(a, b, G, factorised=True)
        assert torch.allclose(fact[:, tril], exact[:, tril], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("chunk, gate", [(32, -4.99), (32, -2.0), (64, -0.5)])
def test_chunked_gradients_are_finite_and_match_the_recurrence(chunk, gate):
    """Training backpropagates through the chunked form: near the K3 gate bound the factorised
    pairwise decay overflows above the diagonal, which must not leak NaN into any gradient."""
    gen = torch.Generator().manual_seed(int(-gate * 10) + chunk)
    T, H, K, V = 70, 2, 16, 8
    q, k, v = (torch.randn(T, H, d, generator=gen, dtype=torch.float64) for d in (K, K, V))
    k = torch.nn.functional.normalize(k, dim=-1)
    g = gate * (0.9 + 0.1 * torch.rand(T, H, K, generator=gen, dtype=torch.float64))
    beta = torch.rand(T, H, generator=gen, dtype=torch.float64)
    s0 = torch.randn(H, K, V, generator=gen, dtype=torch.float64)
    grads = []
    for fn in ("chunked", "recurrent"):
        xs = [t.clone().float().requires_grad_() for t in (q, k, v, g, beta, s0)]
        if fn == "chunked":
            o, s = kda_chunked_ref(*xs[:5], 0.25, xs[5], chunk_size=chunk)
        else:
            o, s = kda_recurrent_ref(*(t[None] for t in xs[:5]), 0.25, xs[5][None])
            o, s = o[0], s[0]
        (o.square().sum() + s.square().sum()).backward()
        grads.append([x.grad for x in xs])
    for gc, gr in zip(*grads):
        assert torch.isfinite(gc).all()
        assert torch.allclose(gc, gr, rtol=1e-3, atol=1e-3 * gr.abs().max().item())


@pytest.mark.parametrize("seed", range(3))
def test_varlen_core_folds_equal_lengths_into_heads_exactly(seed):
    """kda_core's torch path runs equal-length prefill chunks as one call (sequences folded into
    heads): each sequence's output and final state equal its own per-token recurrence, with
    decodes, fresh sequences, cached initial states and an odd length in the same batch."""
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.ops.kda import kda_core

    gen = torch.Generator().manual_seed(seed)
    H, K, V = 2, 16, 8
    #            (new tokens, context): 2 decodes, then prefills of lengths 37, 37, 37, 20
    layout = [(1, 5), (1, 0), (37, 0), (37, 11), (37, 0), (20, 3)]
    chunks = [SeqChunk([0] * n, ctx, slot, [slot]) for slot, (n, ctx) in enumerate(layout)]
    batch = ForwardBatch.build(chunks, 64, "cpu")
    T = batch.num_tokens
    q, k, v, g, beta = _inputs(T, H, K, V, -5.0, gen)
    state = torch.randn(len(layout) + 2, H, K, V, generator=gen)
    before = state.clone()
    out = kda_core(q, k, v, g, beta, K ** -0.5, state, batch, backend="torch")
    for i, (n, ctx) in enumerate(layout):
        s, e = batch.token_range(i)
        s0 = before[i] if ctx else torch.zeros(H, K, V)
        o_ref, s_ref = kda_recurrent_ref(q[None, s:e], k[None, s:e], v[None, s:e], g[None, s:e], beta[None, s:e],
                                         K ** -0.5, s0[None])
        assert torch.allclose(out[s:e], o_ref[0], atol=1e-5, rtol=1e-5), i
        assert torch.allclose(state[i], s_ref[0], atol=1e-5, rtol=1e-5), i
    assert torch.equal(state[len(layout):], before[len(layout):])  # other slots untouched


def test_reference_core_stays_fp32_under_a_bf16_autocast():
    """The trainer runs the model under bf16 autocast; the reference KDA core must not drop to bf16."""
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.ops.kda import kda_core

    gen = torch.Generator().manual_seed(5)
    H, K, V = 2, 16, 8
    batch = ForwardBatch.build([SeqChunk([0] * 40, 0, 0, [0]), SeqChunk([0] * 40, 0, 1, [1])], 64, "cpu")
    q, k, v, g, beta = _inputs(batch.num_tokens, H, K, V, -5.0, gen)
    plain_state, cast_state = torch.zeros(2, H, K, V), torch.zeros(2, H, K, V)
    plain = kda_core(q, k, v, g, beta, K ** -0.5, plain_state, batch, backend="torch")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cast = kda_core(q, k, v, g, beta, K ** -0.5, cast_state, batch, backend="torch")
    assert cast.dtype == torch.float32 and torch.equal(cast, plain) and torch.equal(cast_state, plain_state)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_core_computes_the_decay_from_the_gate_pre_activation(lower_bound):
    """kda_core(gate=(A_log, dt_bias, lower_bound)) takes f and computes kda_gate(f) itself (fla does
    it inside its chunk kernel): the same output and states as passing the decay."""
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.ops.kda import kda_core
    from k3serve.ops.kda_ref import kda_gate

    gen = torch.Generator().manual_seed(3)
    H, K, V = 2, 16, 8
    batch = ForwardBatch.build([SeqChunk([0], 4, 0, [0]), SeqChunk([0] * 30, 0, 1, [1])], 64, "cpu")
    q, k, v, _, beta = _inputs(batch.num_tokens, H, K, V, -5.0, gen)
    f = torch.randn(batch.num_tokens, H, K, generator=gen) * 2
    A_log, dt_bias = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    s1, s2 = torch.randn(2, 2, H, K, V, generator=gen).unbind(0)
    s2.copy_(s1)
    a = kda_core(q, k, v, f, beta, K ** -0.5, s1, batch, backend="torch", gate=(A_log, dt_bias, lower_bound))
    b = kda_core(q, k, v, kda_gate(f, A_log, dt_bias, lower_bound), beta, K ** -0.5, s2, batch, backend="torch")
    assert torch.equal(a, b) and torch.equal(s1, s2)
    c = kda_core(q, k, v, f, beta, K ** -0.5, s2.clone(), batch, backend="torch")  # f as a decay: differs
    assert not torch.allclose(a, c)

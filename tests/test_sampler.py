"""Tests for k3serve.engine.sampler: each sampling parameter has a test that fails if it is ignored."""

from __future__ import annotations

import pytest
import torch

from k3serve.engine.sampler import (Sampler, SamplingRow, apply_penalties, apply_token_biases, make_generator,
                                    mask_min_tokens)
from k3serve.engine.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(prompt=(), output=(), eos=(), gen=None, **kw) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), list(eos), gen)


def draw(logits_1d: torch.Tensor, n: int, seed: int = 0, **kw) -> torch.Tensor:
    """n independent unseeded draws from one distribution, as one batch of n identical rows."""
    sampler = Sampler(torch.Generator(device=logits_1d.device).manual_seed(seed))
    return sampler(logits_1d.expand(n, -1).contiguous(), [row(**kw) for _ in range(n)]).token_ids


# ---------------------------------------------------------------- greedy and degenerate filters


def test_greedy_is_argmax():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(16)])
    assert out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(-1))


@pytest.mark.parametrize("kw", [dict(top_k=1), dict(top_p=1e-6)])
def test_top_k_1_and_tiny_top_p_equal_greedy(kw):
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    out = Sampler(torch.Generator().manual_seed(0))(logits, [row(temperature=1.0, **kw) for _ in range(64)])
    assert torch.equal(out.token_ids, logits.argmax(-1))


# ---------------------------------------------------------------- temperature


def test_low_temperature_concentrates():
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    cold = (draw(logits, 4000, temperature=0.2) == 0).float().mean()
    hot = (draw(logits, 4000, temperature=5.0) == 0).float().mean()
    assert cold > 0.9 and hot < 0.4


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(draw(logits, n, seed=3, temperature=temperature), minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, -1) * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.0, (chi2, counts, expected)  # df=4: p(chi2 > 18.5) = 0.001
    # Ignoring the temperature (T=1) would be far off.
    wrong = torch.softmax(logits.double(), -1) * n
    assert ((counts - wrong) ** 2 / wrong).sum().item() > 200.0


# ---------------------------------------------------------------- top-k / top-p / min-p

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])  # cumsum 0.4, 0.65, 0.80, ...


def test_top_k_2_stays_in_top_2():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9, -1.0])
    seen = set(draw(logits, 5000, top_k=2).tolist())
    assert seen == {1, 3}


def test_top_p_stays_in_nucleus():
    # smallest prefix with mass >= 0.7 is {0, 1, 2} (0.4 + 0.25 < 0.7 <= 0.8)
    seen = set(draw(PROBS.log(), 5000, top_p=0.7).tolist())
    assert seen == {0, 1, 2}


def test_min_p_drops_unlikely_tokens():
    # threshold 0.2 * 0.4 = 0.08: tokens 4 (0.06) and 5 (0.04) are dropped, token 3 (0.1) kept
    seen = set(draw(PROBS.log(), 5000, min_p=0.2).tolist())
    assert seen == {0, 1, 2, 3}


def test_top_k_then_top_p_renormalises():
    # after top_k=3 the mass is 0.8; renormalised 0.5, 0.3125, 0.1875 -> top_p=0.75 keeps {0, 1}
    seen = set(draw(PROBS.log(), 5000, top_k=3, top_p=0.75).tolist())
    assert seen == {0, 1}


# ---------------------------------------------------------------- seeds


def seeded_steps(seed: int, logits_steps: list[torch.Tensor], **kw) -> list[int]:
    gen = make_generator(seed, logits_steps[0].device)
    return [Sampler()(lg.unsqueeze(0), [row(seed=seed, gen=gen, **kw)]).token_ids.item() for lg in logits_steps]


@pytest.fixture
def flat_steps():
    g = torch.Generator().manual_seed(5)
    return [0.1 * torch.randn(200, generator=g) for _ in range(12)]


def test_same_seed_reproduces_sequence(flat_steps):
    a = seeded_steps(42, flat_steps)
    torch.manual_seed(123)  # the global RNG must not matter
    b = seeded_steps(42, flat_steps)
    assert a == b


def test_different_seeds_differ(flat_steps):
    assert seeded_steps(1, flat_steps) != seeded_steps(2, flat_steps)


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_row_same_alone_and_in_batch(device, flat_steps):
    steps = [s.to(device) for s in flat_steps]
    alone = seeded_steps(7, steps, temperature=0.8, top_p=0.95)

    gen7, gen8 = make_generator(7, device), make_generator(8, device)
    other = torch.Generator().manual_seed(9)
    batched = []
    for lg in steps:
        noise = torch.randn(3, 200, generator=other).to(device)
        logits = torch.stack([noise[0], noise[1], lg, noise[2]])
        rows = [
            row(temperature=1.0),
            row(seed=8, gen=gen8),
            row(seed=7, gen=gen7, temperature=0.8, top_p=0.95),
            row(temperature=0.0),
        ]
        batched.append(Sampler()(logits, rows).token_ids[2].item())
    assert batched == alone


def test_seed_without_generator_is_an_error():
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.zeros(1, 4), [row(seed=1)])


# ---------------------------------------------------------------- penalties


def test_repetition_penalty_exact():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0]])
    # token 0 (positive) and 1 (negative) in the output, token 2 only in the prompt; 3, 4 unseen
    out = apply_penalties(logits, [row(prompt=[2], output=[0, 1, 0], repetition_penalty=2.0)])
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 1.5, 0.5, -2.0]]))
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 3.0, 0.5, -2.0]]))  # input untouched


@pytest.mark.parametrize("freq,pres", [(0.5, 0.0), (0.0, 0.25), (0.5, 0.25), (-0.5, 0.0)])
def test_frequency_and_presence_penalties_exact(freq, pres):
    logits = torch.zeros(1, 4)
    # token 0 three times, token 1 once, token 2 only in the prompt (not penalised), token 3 unseen
    out = apply_penalties(logits, [row(prompt=[2, 2], output=[0, 1, 0, 0], frequency_penalty=freq, presence_penalty=pres)])
    expected = torch.tensor([[-3 * freq - pres, -freq - pres, 0.0, 0.0]])
    assert torch.allclose(out, expected)


def test_penalties_only_touch_their_rows():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0))
    rows = [row(output=[1, 2]), row(output=[1, 2], presence_penalty=1.0, repetition_penalty=1.5), row(output=[1, 2])]
    out = apply_penalties(logits, rows)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert not torch.equal(out[1], logits[1])
    assert apply_penalties(logits, [row(), row(), row()]) is logits  # no penalties: no work


def test_logit_bias_and_allowed_token_ids_exact():
    """Bias added on its row's tokens (keys as OpenAI sends them: strings), allowed tokens kept and
    every other -inf, other rows and the input untouched; then penalties see the biased logits."""
    logits = torch.randn(3, 6, generator=torch.Generator().manual_seed(2))
    rows = [row(logit_bias={"1": 5.0, 4: -100}), row(), row(allowed_token_ids=[2, 5], logit_bias={5: 1.5})]
    out = apply_token_biases(logits, rows)
    want = logits.clone()
    want[0, 1] += 5.0
    want[0, 4] -= 100
    want[2] = float("-inf")
    want[2, 2], want[2, 5] = logits[2, 2], logits[2, 5] + 1.5
    assert torch.equal(out, want) and not torch.equal(out, logits)
    assert apply_token_biases(logits, [row(), row(), row()]) is logits
    # through the sampler: greedy follows the bias, sampling never leaves the allowed tokens
    flat = torch.zeros(1, 50)
    assert Sampler()(flat, [row(temperature=0.0, logit_bias={"17": 3.0})]).token_ids.item() == 17
    drawn = draw(torch.randn(50), 400, allowed_token_ids=[3, 9, 41])
    assert set(drawn.tolist()) == {3, 9, 41}


def test_allowed_tokens_that_are_all_stops_outlast_min_tokens():
    """allowed_token_ids = the stops, with min_tokens: masking them left nothing, and argmax of an all
    -inf row is token 0, outside the allowed set (QA found "!!!"); the allowed stop is kept."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0, allowed_token_ids=[7], eos=[7], min_tokens=3),
            row(temperature=1.0, allowed_token_ids=[9, 11], stop_token_ids=[9, 11], min_tokens=2, seed=4,
                gen=torch.Generator().manual_seed(4))]
    assert Sampler()(logits, rows).token_ids.tolist()[0] == 7
    assert Sampler()(logits, rows).token_ids.tolist()[1] in (9, 11)


@pytest.mark.parametrize("kw,needle", [(dict(logit_bias={"x": 1.0}), "logit_bias must map token ids to numbers"),
                                       (dict(logit_bias={3: 101}), "biases in [-100, 100]"),
                                       (dict(logit_bias={-1: 1}), "biases in [-100, 100]"),
                                       (dict(allowed_token_ids=[]), "allowed_token_ids must be"),
                                       (dict(allowed_token_ids=[1, "2"]), "allowed_token_ids must be")])
def test_bias_params_refused(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kw)


def test_presence_penalty_flips_greedy_choice():
    logits = torch.tensor([[1.0, 0.9]])
    assert Sampler()(logits, [row(output=[0], temperature=0.0)]).token_ids.item() == 0
    assert Sampler()(logits, [row(output=[0], temperature=0.0, presence_penalty=0.09)]).token_ids.item() == 0
    assert Sampler()(logits, [row(output=[0], temperature=0.0, presence_penalty=0.11)]).token_ids.item() == 1


# ---------------------------------------------------------------- min_tokens


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_ids(ignore_eos):
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 1.0]])  # 2 = EOS, 3 = stop token id
    kw = dict(eos=[2], min_tokens=3, stop_token_ids=[3], ignore_eos=ignore_eos)
    early = [row(output=[0, 1], temperature=0.0, **kw)] + [row(output=[0, 1], **kw) for _ in range(200)]
    toks = Sampler(torch.Generator().manual_seed(0))(logits.expand(201, -1), early).token_ids
    assert not bool(((toks == 2) | (toks == 3)).any())
    assert toks[0].item() == 4
    # once min_tokens outputs exist, EOS (then the stop id) is allowed again
    done = row(output=[0, 1, 4], temperature=0.0, **kw)
    assert Sampler()(logits, [done]).token_ids.item() == 2
    masked = mask_min_tokens(logits, [row(output=[0, 1, 4], eos=[2], min_tokens=3, stop_token_ids=[3])])
    assert torch.equal(masked, logits)


# ---------------------------------------------------------------- logprobs


def test_logprobs_from_raw_logits():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    rows = [
        row(output=[int(logits[0].argmax())], repetition_penalty=3.0, temperature=0.0, logprobs=2),
        row(temperature=0.5, logprobs=5),
        row(temperature=0.0),  # asked nothing: still filled, the caller trims
    ]
    out = Sampler(torch.Generator().manual_seed(0))(logits, rows)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids[0] != logits[0].argmax()  # the penalty changed the choice...
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))  # ...not the logprob
    assert out.top_ids.shape == (3, 5) and out.top_logprobs.shape == (3, 5)
    ref_lp, ref_ids = raw.topk(5, -1)
    assert torch.equal(out.top_ids, ref_ids) and torch.allclose(out.top_logprobs, ref_lp)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())


def test_logprobs_of_masked_logits_are_the_models():
    """A grammar masks the logits the sampler draws from; the logprobs reported stay the model's
    (the mask's -inf is no logprob, and not valid JSON)."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(3))
    masked = torch.full_like(logits, float("-inf"))
    masked[:, 7] = logits[:, 7]  # only token 7 allowed
    out = Sampler()(masked, [row(temperature=0.0, logprobs=4), row(logprobs=4)], logprob_logits=logits)
    raw = torch.log_softmax(logits, -1)
    assert out.token_ids.tolist() == [7, 7]
    assert torch.allclose(out.logprobs, raw[:, 7]) and torch.allclose(out.top_logprobs, raw.topk(4, -1).values)


def test_min_tokens_under_a_grammar_yields_only_to_its_end():
    """Under a grammar min_tokens masks the stops while the grammar allows anything else, not when
    they are all it allows (its end: masking it too left nothing to sample)."""
    inf = float("-inf")
    allows_more = torch.tensor([[inf, inf, 9.0, 8.0, inf]])  # (a grammar's mask: 2 = EOS or 3)
    only_end = torch.tensor([[inf, inf, 9.0, inf, inf]])
    p = SamplingParams(min_tokens=3, temperature=0.0)
    free, ruled = (SamplingRow(p, [], [0], [2], None, grammar=g) for g in (False, True))
    assert Sampler()(allows_more, [ruled]).token_ids.item() == 3  # still held back
    assert Sampler()(only_end, [ruled]).token_ids.item() == 2  # the grammar's end wins
    assert not torch.isfinite(mask_min_tokens(only_end, [free])).any()  # (without the grammar flag)


def test_logprobs_none_when_not_requested_and_zero_k():
    logits = torch.randn(2, 10)
    out = Sampler()(logits, [row(), row(temperature=0.0)])
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None
    out = Sampler()(logits, [row(logprobs=0), row(temperature=0.0)])
    assert out.logprobs.shape == (2,) and out.top_ids.shape == (2, 0)


# ---------------------------------------------------------------- mixed batch


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_matches_rows_alone(device):
    g = torch.Generator().manual_seed(11)
    V, steps = 64, 6
    specs = [  # (kwargs, seed or None); greedy and seeded rows must match their solo runs
        (dict(temperature=0.0), None),
        (dict(temperature=0.7, top_k=20, seed=1), 1),
        (dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2), None),
        (dict(temperature=1.0), None),  # unseeded: only checked to run
        (dict(temperature=1.2, top_p=0.9, min_p=0.05, presence_penalty=0.5, seed=2), 2),
        (dict(temperature=0.0, min_tokens=10), None),
        (dict(temperature=0.9, repetition_penalty=1.5, seed=3, logprobs=3), 3),
    ]
    logits = [torch.randn(len(specs), V, generator=g).to(device) for _ in range(steps)]
    prompt = [3, 5, 7, 7]

    def run(indices):
        gens = {i: make_generator(specs[i][1], device) for i in indices if specs[i][1] is not None}
        outs = {i: [] for i in indices}
        sampler = Sampler()
        for lg in logits:
            rows = [row(prompt, outs[i], [0], gens.get(i), **specs[i][0]) for i in indices]
            toks = sampler(lg[indices], rows).token_ids.tolist()
            for i, t in zip(indices, toks):
                outs[i].append(t)
        return outs

    batched = run(list(range(len(specs))))
    for i, (kw, seed) in enumerate(specs):
        if kw["temperature"] == 0.0 or seed is not None:
            assert batched[i] == run([i])[i], (i, kw)
    assert 0 not in batched[5]  # min_tokens row never emitted EOS

"""The sort-free sampling kernel (ops/sampling_triton.py) against the sorting reference
(engine/sampler.filter_logits and the exponential race), on CPU through Triton's interpreter (each
phase a launch: the GPU's one-launch form with grid barriers is checked by
bench/gpu_check_kernels.py --sampling)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.sampling_triton import sample_filtered, keys
    from k3serve.engine.sampler import filter_logits
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    done = 0
    # (V > BLOCK: a row's programs take several blocks, and two programs a row under the interpreter)
    for S, V in [(4, 2500), (2, 9000), (1, 700)]:
        logits = torch.randn(S + 2, V, generator=gen) * torch.rand(S + 2, 1, generator=gen) * 6
        rows = torch.randperm(S + 2, generator=gen)[:S]  # the sampled rows of a batch
        logits[rows[0], V // 3:] = float("-inf")  # masked tokens (e.g. min_tokens' EOS, a grammar)
        temp = torch.rand(S, generator=gen) + 0.5
        x = logits[rows] / temp[:, None]
        q = torch.empty(S, V).exponential_(generator=gen)
        for top_k, top_p, min_p in [((0, 5, 50), (0.9, 1.0, 0.5), (0.0, 0.0, 0.1)),
                                    ((0,), (0.95,), (0.0,)), ((7, 3000), (1.0,), (0.0,)),
                                    ((0,), (1.0,), (0.05, 0.0)), ((1,), (1.0,), (0.0,)),
                                    ((0, 40), (0.3, 0.999), (0.02, 0.0)), ((0,), (1.0,), (0.0,))]:
            tk = torch.tensor([top_k[i % len(top_k)] for i in range(S)])
            tp = torch.tensor([top_p[i % len(top_p)] for i in range(S)], dtype=torch.float32)
            mp = torch.tensor([min_p[i % len(min_p)] for i in range(S)], dtype=torch.float32)
            has = (bool((tk > 0).any()), bool((tp < 1).any()), bool((mp > 0).any()))
            tau = torch.empty(S, dtype=torch.int64)
            tok = sample_filtered(logits, rows, q, torch.stack([temp, tk.float(), tp, mp]), *has, tau=tau)
            ref = filter_logits(x, tk, tp, mp)
            kept = (keys(x) >= tau[:, None]) & (x > float("-inf"))
            kept &= torch.exp(x - x.max(1, keepdim=True).values) >= mp[:, None]
            assert torch.equal(kept, ref > float("-inf")), (S, V, top_k, top_p, min_p, kept.sum(1), (ref > -1e30).sum(1))
            want = (ref.softmax(-1) / q).argmax(-1)
            assert torch.equal(tok, want), (tok, want)
            assert bool(kept.gather(1, tok[:, None]).all())
            if V > 8192:  # a row's sums by block, not by program: the same whatever the batch leaves it
                for programs in (1, 3):
                    again = torch.empty_like(tau)
                    assert torch.equal(sample_filtered(logits, rows, q, torch.stack([temp, tk.float(), tp, mp]), *has,
                                                       tau=again, programs=programs), tok)
                    assert torch.equal(again, tau)
            done += S
    assert done == (4 + 2 + 1) * 7

    # Blocks skipped by their maximum (SKIP): peaked rows (a few tokens far above a narrow bulk,
    # as a model's logits), where the later passes and the draw skip most blocks, and broad ones;
    # the kept sets, thresholds and tokens are those of reading every block.
    from k3serve.ops.sampling_triton import BLOCK
    S, V = 3, 9000
    for peaked in (True, False):
        logits = torch.randn(S, V, generator=gen) * (0.5 if peaked else 4.0)
        if peaked:
            logits.scatter_(1, torch.randint(0, V, (S, 20), generator=gen), 15 + 5 * torch.rand(S, 20, generator=gen))
        rows, temp = torch.arange(S), torch.rand(S, generator=gen) * 0.5 + 0.5
        x = logits / temp[:, None]
        q = torch.empty(S, V).exponential_(generator=gen)
        for top_k, top_p, min_p in [((0,), (0.9,), (0.0,)), ((10, 0, 5), (0.8, 0.95, 1.0), (0.0, 0.05, 0.0))]:
            tk, tp, mp = (torch.tensor(v * S)[:S] for v in (top_k, top_p, min_p))
            params = torch.stack([temp, tk.float(), tp.float(), mp.float()])
            has = (bool((tk > 0).any()), bool((tp < 1).any()), bool((mp > 0).any()))
            tau, tau_all = torch.empty(S, dtype=torch.int64), torch.empty(S, dtype=torch.int64)
            tok = sample_filtered(logits, rows, q, params, *has, tau=tau, skip=True)
            ref = filter_logits(x, tk, tp.float(), mp.float())
            kept = (keys(x) >= tau[:, None]) & (torch.exp(x - x.max(1, keepdim=True).values) >= mp[:, None])
            assert torch.equal(kept, ref > float("-inf")), (peaked, top_k, top_p)
            assert torch.equal(tok, (ref.softmax(-1) / q).argmax(-1))
            assert torch.equal(sample_filtered(logits, rows, q, params, *has, tau=tau_all, skip=False), tok)
            assert torch.equal(tau_all, tau)
            pad = torch.nn.functional.pad(x, (0, -V % BLOCK), value=float("-inf"))
            skipped = (keys(pad.view(S, -1, BLOCK).amax(2)) < tau[:, None]).float().mean()
            assert skipped > 0.5 or not peaked, skipped  # (the draw's: the test skips)
            for programs in (1, 2):
                assert torch.equal(sample_filtered(logits, rows, q, params, *has, programs=programs), tok)
            done += 1
    assert done == (4 + 2 + 1) * 7 + 4
    print(0.0)
''')


def test_sort_free_filters_keep_what_the_sort_keeps_and_draw_the_same_token():
    """Top-k, top-p on the top-k's renormalised mass, min-p, alone and together, rows with masked
    tokens: the kept set equals the sorting reference's and, on the same noise, the token too."""
    assert worst_error(SCRIPT, "0") == 0.0


SAMPLER_SCRIPT = textwrap.dedent('''
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.engine import sampler as smp
    from k3serve.engine.sampling_params import SamplingParams
    V = 1000
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, seed=3),
              SamplingParams(temperature=1.2, top_k=20), SamplingParams(temperature=0.7, min_p=0.05,
                                                                         repetition_penalty=1.3),
              SamplingParams(temperature=1.0, top_k=50, top_p=0.8, min_p=0.01, seed=11)]
    tokens = {}
    for kernel in (False, True):
        smp.KERNEL = kernel
        sampler, out = smp.Sampler(torch.Generator().manual_seed(1)), []
        gens = [smp.make_generator(p.seed) if p.seed is not None else None for p in params]
        for step in range(4):
            rows = [smp.SamplingRow(p, [1, 2, 3], [4, 5][:step], [0], g) for p, g in zip(params, gens)]
            out.append(sampler(logits + step, rows).token_ids.tolist())
        tokens[kernel] = out
    assert tokens[True] == tokens[False], tokens
    print(0.0)
''')


def test_sampler_draws_the_same_tokens_with_the_kernel():
    """A mixed batch (greedy, seeded, top-k, min-p with a penalty, all filters) over steps: the
    Sampler's tokens with the kernel equal the sorting path's, seeded rows from their generators."""
    assert worst_error(SAMPLER_SCRIPT) == 0.0

"""The flash-style Triton MLA prefill against the expanded reference (causal, with cached
context), on CPU through Triton's interpreter (TRITON_INTERPRET=1)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.mla_prefill_triton import mla_prefill
    from k3serve.ops.mla_ref import mla_expanded_ref
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for Ha, dn, dr, dv, rkv, ctx, Tq in [(2, 32, 16, 32, 64, 0, 37), (3, 64, 32, 64, 64, 45, 20),
                                         (4, 32, 16, 16, 32, 100, 1), (1, 16, 16, 32, 32, 7, 70),
                                         (2, 32, 8, 48, 64, 10, 25), (3, 24, 4, 40, 32, 0, 19)]:
        q = torch.randn(Tq, Ha, dn + dr, generator=gen)
        latent = torch.randn(ctx + Tq, rkv + dr, generator=gen)
        w = torch.randn(Ha * (dn + dv), rkv, generator=gen) / rkv ** 0.5
        scale = (dn + dr) ** -0.5
        ref = mla_expanded_ref(q, latent, w, ctx, rkv, dn, scale)
        for tiles in (dict(BLOCK_M=16, BLOCK_N=16), None):  # None: the autotuned launch the model makes
            out = mla_prefill(q, latent, w, ctx, rkv, dn, scale, tiles=tiles)
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_flash_prefill_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-5

"""MLA prefill through torch's SDPA (``bench.mla_prefill_sdpa``) against the expanded reference on
CPU (SDPA's math backend): fresh prompts, chunks after cached context (causal to the last key), a
single new token on context, value widths other than the keys'."""

import pytest
import torch

from bench.mla_prefill_sdpa import mla_prefill_sdpa
from k3serve.ops.mla_ref import mla_expanded_ref


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("Ha, dn, dr, dv, rkv, ctx, Tq", [
    (2, 32, 16, 32, 64, 0, 37), (3, 64, 32, 64, 64, 45, 20), (4, 32, 16, 16, 32, 100, 1),
    (1, 16, 16, 32, 32, 7, 70), (2, 32, 8, 48, 64, 10, 25), (3, 24, 4, 40, 32, 0, 19)])
def test_sdpa_prefill_matches_reference(seed, Ha, dn, dr, dv, rkv, ctx, Tq):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(Tq, Ha, dn + dr, generator=gen)
    latent = torch.randn(ctx + Tq, rkv + dr, generator=gen)
    w = torch.randn(Ha * (dn + dv), rkv, generator=gen) / rkv ** 0.5
    scale = (dn + dr) ** -0.5
    ref = mla_expanded_ref(q, latent, w, ctx, rkv, dn, scale)
    out = mla_prefill_sdpa(q, latent, w, ctx, rkv, dn, scale)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 1e-5

"""The Triton split-KV MLA decode kernel against the plain-torch absorbed reference, run on CPU
through Triton's interpreter (TRITON_INTERPRET=1); the GPU check and timing live in bench/."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.mla_decode_triton import mla_decode
    from k3serve.ops.mla_ref import mla_absorbed_ref
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for H, rkv, dr, page, lens, splits in [(4, 64, 16, 16, [1, 17, 64, 90], 1), (20, 64, 32, 16, [5, 33, 130], 3),
                                            (16, 128, 64, 64, [200, 64, 1], 4), (8, 32, 16, 8, [40], 8),
                                            (4, 48, 8, 16, [3, 50], 2), (6, 64, 16, 16, [600, 9], None)]:  # None: default
        B, width = len(lens), rkv + dr
        max_pages = max(-(-n // page) for n in lens)
        n_pages = B * max_pages + 3
        # a strided pool view: pages interleaved with another layer's pages
        pool = torch.randn(n_pages, 2, page, width, generator=gen)
        latent = pool[:, 1]
        perm = torch.randperm(n_pages, generator=gen)
        table = perm[: B * max_pages].view(B, max_pages)
        seq_lens = torch.tensor(lens)
        q = torch.randn(B, H, width, generator=gen)
        scale = 0.11
        out = mla_decode(q, latent, table, seq_lens, rkv, scale, num_splits=splits)
        # the same query as a strided absorbed part and a separate q_pe (the model's decode call)
        q_c = torch.cat([q[..., :rkv], torch.zeros(B, H, 3)], -1)[..., :rkv].transpose(0, 1).contiguous().transpose(0, 1)
        out_split = mla_decode(q_c, latent, table, seq_lens, rkv, scale, num_splits=splits, q_pe=q[..., rkv:])
        assert torch.allclose(out_split, out, atol=1e-6), "q_pe apart differs"
        S = max(lens)
        lat = latent[table].flatten(1, 2)[:, :S]
        mask = torch.arange(S)[None, :] < seq_lens[:, None]
        ref = mla_absorbed_ref(q[:, None], lat, mask[:, None], rkv, scale)[:, 0]
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_split_kv_decode_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-5


UNABSORB_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.mla_decode_triton import merge_unabsorb, mla_decode
    from k3serve.ops.mla_ref import unabsorb_output
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # (sequences, heads, splits, rkv, nope, dv, gate, dtype): empty splits (lse -inf) with garbage
    # partials must weigh nothing; ragged rkv and dv; the output gate; fp32 and bf16 outputs
    for B, H, S, R, dn, dv, gated, dtype in [(1, 4, 8, 64, 16, 32, False, torch.float32),
                                             (3, 2, 3, 48, 8, 24, True, torch.float32),
                                             (2, 5, 1, 64, 16, 16, True, torch.bfloat16),
                                             (140, 1, 2, 32, 8, 16, False, torch.float32)]:
        part = torch.randn(B, H, S, R, generator=gen)
        lse = torch.randn(B, H, S, generator=gen) * 3
        if S > 1:
            lse[:, :, -1] = float("-inf")
            part[:, :, -1] = float("nan")
        w = torch.randn(H * (dn + dv), R, generator=gen).bfloat16()
        gate = torch.randn(B, H * dv, generator=gen) if gated else None
        out = merge_unabsorb(part, lse, w, dn, gate, dtype)
        wt = torch.softmax(lse, -1)
        o_lat = (wt[..., None] * torch.where(wt[..., None] > 0, part, 0.0)).sum(2)
        ref = unabsorb_output(o_lat, w.float(), R, dn).reshape(B, H * dv)
        if gated:
            ref = ref * torch.sigmoid(gate)
        assert out.shape == (B, H * dv) and out.dtype == dtype
        tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8
        worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item() / tol)
    # through mla_decode: the same as its latent output unabsorbed in torch
    B, H, R, dr, page = 2, 4, 64, 16, 16
    latent = torch.randn(9, page, R + dr, generator=gen)
    table = torch.randperm(9, generator=gen)[:8].view(2, 4)
    q = torch.randn(B, H, R + dr, generator=gen)
    lens = torch.tensor([37, 5])
    w = torch.randn(H * (16 + 32), R, generator=gen).bfloat16()
    ref = unabsorb_output(mla_decode(q, latent, table, lens, R, 0.1, num_splits=4), w.float(), R, 16).reshape(B, -1)
    out = mla_decode(q, latent, table, lens, R, 0.1, num_splits=4, unabsorb=(w, 16, None, torch.float32))
    worst = max(worst, ((out - ref).norm() / ref.norm()).item() / 1e-6)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_merge_and_unabsorb_in_one_launch_matches_torch(seed):
    """The splits' LSE merge, W_UV (bf16 weights, fp32 products), the output gate and the cast in
    one kernel, against softmax + matmul + the fp32 einsum in torch."""
    assert worst_error(UNABSORB_SCRIPT, str(seed)) < 1.0

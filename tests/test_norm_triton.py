"""The one-kernel RMSNorm against the torch reference, on CPU through Triton's interpreter."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import rms_norm
    from k3serve.ops import norm_triton
    from k3serve.ops.norm_triton import rms_norm_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    norm_triton.NORM_MANY_ROWS = int(sys.argv[2])  # 1: several rows a program at every size
    worst = 0.0
    for shape, weighted, dtype, out_dtype in [((5, 96), True, torch.float32, None), ((3, 4, 48), True, torch.float32, torch.float32),
                                             ((7, 100), False, torch.float32, None), ((2, 64), True, torch.bfloat16, torch.float32),
                                             ((1, 2304), True, torch.bfloat16, None)]:
        x = (torch.randn(*shape, generator=gen) * 3).to(dtype)
        w = torch.rand(shape[-1], generator=gen) + 0.5 if weighted else None
        strided = torch.cat([x, torch.zeros(*shape[:-1], 3, dtype=dtype)], -1)[..., :shape[-1]]  # rows not dense
        for inp in (x, strided):
            out = rms_norm_triton(inp, w, 1e-5, out_dtype)
            assert out.shape == inp.shape and out.dtype == rms_norm(inp, w, 1e-5, out_dtype).dtype
            exact = rms_norm(inp, w, 1e-5, torch.float32)  # bf16 outputs are judged at bf16's precision
            tol = 1e-5 if out.dtype == torch.float32 else 2.0 ** -8
            worst = max(worst, ((out.float() - exact).norm() / exact.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed,many_rows", [(0, 1024), (1, 1)])
def test_rms_norm_kernel_matches_reference(seed, many_rows):
    """One row a program, and (many_rows=1) several: the last program's rows partly past the end."""
    assert worst_error(SCRIPT, str(seed), str(many_rows)) < 1.0  # errors relative to each case's tolerance


ADD_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import RMSNorm
    from k3serve.ops.norm_triton import add_rms_norm_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # (1100 rows of 128: a tile of rows a program, the last one partial)
    for T, D, dtype in [(5, 96, torch.float32), (3, 100, torch.float32), (4, 64, torch.bfloat16), (1, 2304, torch.bfloat16),
                        (1100, 128, torch.float32), (1030, 96, torch.bfloat16)]:
        norm = RMSNorm(D, 1e-5, dtype)
        norm.weight.data = (torch.rand(D, generator=gen) + 0.5).to(dtype)
        h, delta = (torch.randn(T, D, generator=gen) * 2).to(dtype), torch.randn(T, D, generator=gen).to(dtype)
        h_ref = h + delta
        h_out, y = add_rms_norm_triton(h, delta, norm.weight, norm.eps)
        if dtype == torch.float32:
            assert torch.equal(h_out, h_ref)  # the residual stream is exactly torch's add
        else:  # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest, as torch): <= 1 ulp
            ulp = torch.finfo(torch.bfloat16).eps * h_ref.float().abs().clamp_min(2.0 ** -126)
            assert ((h_out.float() - h_ref.float()).abs() <= ulp).all()
        exact = norm(h_ref, out_dtype=torch.float32)
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7  # bf16: one ulp (the interpreter truncates twice)
        worst = max(worst, ((y.float() - exact).norm() / exact.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_residual_add_and_norm_matches_reference(seed):
    assert worst_error(ADD_SCRIPT, str(seed)) < 1.0


GATED_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import rms_norm
    from k3serve.ops import norm_triton
    from k3serve.ops.norm_triton import rms_norm_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    norm_triton.NORM_MANY_ROWS = int(sys.argv[2])
    worst = 0.0
    for T, H, D, dtype, out_dtype in [(5, 3, 32, torch.float32, torch.float32), (4, 2, 64, torch.bfloat16, torch.bfloat16),
                                      (1, 4, 16, torch.float32, torch.bfloat16)]:
        x = (torch.randn(T, H, D, generator=gen) * 3).to(dtype)
        w = torch.rand(D, generator=gen) + 0.5
        wide = (torch.randn(T, H * D + 5, generator=gen) * 2).to(dtype)
        gate = wide[:, 2:2 + H * D]  # a strided split of the fused input projection
        out = rms_norm_triton(x, w, 1e-5, out_dtype, gate=gate)
        exact = rms_norm(x, w, 1e-5, torch.float32) * torch.sigmoid(gate.float().view(T, H, D))
        assert out.shape == x.shape and out.dtype == out_dtype
        tol = 1e-5 if out_dtype == torch.float32 else 2.0 ** -7
        worst = max(worst, ((out.float() - exact).norm() / exact.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed,many_rows", [(0, 1024), (1, 1)])
def test_gated_norm_matches_reference(seed, many_rows):
    """KDA's output norm times sigmoid(gate), the gate's heads read from a strided [T, H*D] row;
    one row a program, and (many_rows=1) several, rows of different tokens and heads in one."""
    assert worst_error(GATED_SCRIPT, str(seed), str(many_rows)) < 1.0


LATENT_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import rms_norm
    from k3serve.ops.norm_triton import latent_to_cache, rms_norm_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for T, R, DR, page, dtype in [(1, 64, 16, 8, torch.float32), (5, 48, 8, 4, torch.bfloat16), (3, 512, 64, 16, torch.bfloat16)]:
        wide = torch.randn(T, 7 + R + DR, generator=gen).to(dtype)
        kv = wide[:, 7:]  # strided rows: a column slice of the fused input projection
        w = (torch.rand(R, generator=gen) + 0.5).to(dtype)
        layers = torch.randn(6, 2, page, R + DR, generator=gen).to(dtype)
        cache = layers[:, 1]  # a strided per-layer view of the pool
        before = layers.clone()
        slot = torch.randperm(6 * page, generator=gen)[:T]
        page_ix, offset = slot // page, slot % page
        latent_to_cache(kv, w, 1e-6, cache, page_ix, offset)
        ref = before.clone()
        ref[:, 1][page_ix, offset] = torch.cat([rms_norm_triton(kv[:, :R], w, 1e-6), kv[:, R:]], -1)
        assert torch.equal(layers, ref), (T, R, dtype)  # the norm kernel's bits, nothing else touched
        exact = rms_norm(kv[:, :R], w, 1e-6, torch.float32)
        tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8
        worst = max(worst, ((cache[page_ix, offset, :R].float() - exact).norm() / exact.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_latent_rows_normed_and_written_to_their_pages_in_one_launch(seed):
    """MLA's new cache rows: the latent normed, k_pe copied, stored at (page, offset) of a strided
    cache view; the same bits as the norm kernel, the concatenation and the indexed store."""
    assert worst_error(LATENT_SCRIPT, str(seed)) < 1.0

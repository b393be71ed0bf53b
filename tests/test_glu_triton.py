"""The one-kernel GLU activation against the torch reference, on CPU through Triton's
interpreter: SiLU-GLU and SiTU-GLU with and without the linear clip, fp32 and bf16, gate and up
as the two strided halves of one fused GEMM output, several widths (one and several column
blocks)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import glu_activation
    from k3serve.ops.glu_triton import glu_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for rows, n, dtype in [((3,), 64, torch.float32), ((2, 5), 1500, torch.float32), ((4,), 96, torch.bfloat16)]:
        fused = (torch.randn(*rows, 2 * n, generator=gen) * 4).to(dtype)  # one gate|up GEMM output
        gate, up = fused[..., :n], fused[..., n:]
        assert not gate.is_contiguous()
        for act, beta, lb in [("silu", 1.0, None), ("situ", 1.5, None), ("situ", 2.0, 3.0), ("sigmoid", 1.0, None)]:
            ref = glu_activation(gate.float(), up.float(), act, beta, lb)
            out = glu_triton(gate, up, act, beta, lb)
            assert out.shape == gate.shape and out.dtype == dtype
            tol = 1e-5 if dtype == torch.float32 else 2.0 ** -8  # bf16 outputs at bf16's precision
            worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item() / tol)
    # MLA's output gate: a bf16 gate and the fp32 attention output, rounded once to bf16
    gate = torch.randn(3, 80, generator=gen).bfloat16()
    o = torch.randn(3, 80, generator=gen)
    ref = torch.sigmoid(gate.float()) * o
    out = glu_triton(gate, o, "sigmoid")
    assert out.dtype == torch.bfloat16 and torch.equal(glu_activation(gate, o, "sigmoid"), ref.bfloat16())
    worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item() / 2.0 ** -8)
    # a split-K GEMM's fp32 partials (row r's in rows r * split ..): summed in order, then the GLU, into out
    for split, rows, n in [(2, 3, 64), (6, 9, 1024), (3, 1, 40)]:
        parts = torch.randn(rows * split, 2 * n, generator=gen)
        sums = parts.view(rows, split, 2 * n).sum(1)
        for act, beta, lb in [("silu", 1.0, None), ("situ", 2.0, 3.0)]:
            ref = glu_activation(sums[:, :n], sums[:, n:], act, beta, lb)
            out = torch.full((rows, n), float("nan")).bfloat16()
            assert glu_triton(parts[:, :n], parts[:, n:], act, beta, lb, split=split, out=out) is out
            worst = max(worst, ((out.float() - ref).norm() / ref.norm()).item() / 2.0 ** -8)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_glu_kernel_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1.0


def test_unknown_activation_is_an_error():
    import torch

    from k3serve.ops.glu_triton import glu_triton

    with pytest.raises(ValueError, match="unknown activation"):
        glu_triton(torch.zeros(2, 4), torch.zeros(2, 4), "gelu")
    with pytest.raises(ValueError, match="split=4 must divide the 6 rows"):
        glu_triton(torch.zeros(6, 4), torch.zeros(6, 4), "silu", split=4)

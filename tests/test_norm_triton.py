"""The one-kernel RMSNorm against the torch reference, on CPU through Triton's interpreter."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import rms_norm
    from k3serve.ops.norm_triton import rms_norm_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
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


@pytest.mark.parametrize("seed", [0, 1])
def test_rms_norm_kernel_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1.0  # errors are printed relative to each case's tolerance

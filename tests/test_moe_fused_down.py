"""bench/moe_fused_down.py's one-token MoE (gate/up and down in one kernel, split-K over the
intermediate) against the reference experts, on CPU through Triton's interpreter; its sm_90 build
compiled. GPU timing: ``python3 -m bench.moe_fused_down``."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from bench.moe_fused_down import moe_one_token_fused
    from k3serve.ops.moe_ref import experts_ref
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # (experts, chosen, I, K = D, act, tile): ragged blocks of the intermediate and of D, SiLU and SiTU
    for E, A, I, K, act, tile in [(6, 3, 96, 80, ("silu", 1.0, None), dict(block_i=32, block_k=32, block_d=32)),
                                  (5, 5, 64, 130, ("situ", 4.0, 25.0), dict(block_i=64, block_k=64, block_d=16)),
                                  (9, 2, 40, 48, ("silu", 1.0, None), dict(block_i=16, block_k=128, block_d=64))]:
        w1, w3 = (torch.randn(E, I, K, generator=gen) / K ** 0.5 for _ in range(2))
        w2 = torch.randn(E, K, I, generator=gen) / I ** 0.5
        x = torch.randn(1, K, generator=gen)
        ids = torch.randperm(E, generator=gen)[:A].view(1, A)
        weights = torch.rand(1, A, generator=gen) + 0.5
        ref = experts_ref(x, weights, ids, lambda e: (w1[e], w2[e], w3[e]), *act)
        out = moe_one_token_fused(x, w1, w3, w2, weights, ids, act, **tile)
        assert out.shape == (1, K) and out.dtype == torch.float32
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_gate_up_down_matches_reference(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-5


def test_fused_gate_up_down_compiles_for_sm90():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("Triton's NVIDIA backend is not installed")
    import triton

    from bench.moe_fused_down import _gate_up_down_kernel

    sig = {"X": "*bf16", "W1": "*bf16", "W3": "*bf16", "W2": "*bf16", "IDS": "*i64", "ROW_SCALE": "*fp32",
           "PART": "*fp32", "K": "i32", "I": "i32", "D": "i32", "beta": "fp32", "linear_beta": "fp32"}
    consts = dict(BLOCK_I=64, BLOCK_K=128, BLOCK_D=64, SITU=False, LINEAR_CLIP=False, USE_PDL=True)
    src = triton.compiler.ASTSource(fn=_gate_up_down_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                                    constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= wait < ptx.find("ld.global")

"""The split-K GEMV (dense linears of a decode step) against float64, on CPU through Triton's
interpreter; its Hopper build (bf16 MMA, the ticket) compiled for sm_90. GPU timing: bench/."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.gemv_triton import gemv
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # (tokens, N, K, tile): ragged N and K, one to four splits, the tuned default; each twice, so a
    # launch that left a ticket non-zero would break the next one
    for T, N, K, cfg in [(1, 100, 300, None), (3, 64, 512, dict(BLOCK_N=32, BLOCK_K=64, SPLIT_K=4)),
                         (4, 80, 200, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=1)),
                         (2, 48, 1000, dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=3)), (16, 33, 64, None)]:
        x = torch.randn(T, K, generator=gen)
        w = torch.randn(N, K, generator=gen)
        ref = x.double() @ w.double().T
        for _ in range(2):
            y = gemv(x, w, cfg)
            assert y.shape == (T, N) and y.dtype == w.dtype
            worst = max(worst, ((y.double() - ref).norm() / ref.norm()).item())
    # a static weight (read before the PDL wait where a program's K range is one tile): one tile
    # with one and two splits (the second split empty), and several tiles (the loop as before)
    for T, N, K, cfg in [(2, 40, 100, dict(BLOCK_N=16, BLOCK_K=128, SPLIT_K=1)),
                         (1, 24, 120, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2)),
                         (3, 20, 64, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=4)),
                         (1, 36, 300, dict(BLOCK_N=16, BLOCK_K=64, SPLIT_K=2))]:
        x = torch.randn(T, K, generator=gen)
        w = torch.randn(N, K, generator=gen)
        ref = x.double() @ w.double().T
        for _ in range(2):
            worst = max(worst, ((gemv(x, w, cfg, static_weight=True).double() - ref).norm() / ref.norm()).item())
    # a strided row view (a column slice of a fused projection output) as x
    wide = torch.randn(2, 400, generator=gen)
    x, w = wide[:, 50:350], torch.randn(70, 300, generator=gen)
    ref = x.double() @ w.double().T
    worst = max(worst, ((gemv(x, w).double() - ref).norm() / ref.norm()).item())
    # batched: per-batch weights (K-contiguous and N-contiguous), strided x and out views, split
    # partials and tickets per batch; an fp32 out of a bf16 weight (exact here: the interpreter
    # multiplies in fp32, the GPU in bf16, gpu_check_kernels)
    for B, T, N, K, cfg in [(3, 2, 40, 96, dict(BLOCK_N=16, BLOCK_K=32, SPLIT_K=2)), (2, 1, 70, 130, None)]:
        x = torch.randn(T, B, K + 5, generator=gen)[..., :K].transpose(0, 1)
        for w in (torch.randn(B, N, K, generator=gen), torch.randn(B, K, N, generator=gen).transpose(1, 2),
                  torch.randn(B, N, K, generator=gen).bfloat16()):
            ref = x.double() @ w.double().transpose(1, 2)
            out = torch.full((T, B, N), float("nan")).transpose(0, 1)
            for _ in range(2):
                y = gemv(x, w, cfg, out=out)
                assert y is out and not out.isnan().any()
                worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
            y = gemv(x, w, cfg)  # the same sums, rounded once to the weight's dtype
            assert y.shape == (B, T, N) and y.dtype == w.dtype
            assert torch.allclose(y.float(), out, rtol=2 ** -7, atol=0)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_gemv_matches_float64(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-6


def test_gemv_refuses_what_it_does_not_serve():
    import torch

    from k3serve.ops.gemv_triton import gemv

    with pytest.raises(ValueError, match="16 tokens"):
        gemv(torch.zeros(17, 8), torch.zeros(4, 8))
    with pytest.raises(ValueError, match="16 tokens"):  # one weight per batch entry
        gemv(torch.zeros(3, 2, 8), torch.zeros(2, 4, 8))
    with pytest.raises(ValueError, match="output must be"):
        gemv(torch.zeros(2, 8), torch.zeros(4, 8), out=torch.zeros(2, 5))


def test_gemv_compiles_for_sm90_with_bf16_mma_and_a_ticket():
    try:
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:  # pragma: no cover
        pytest.skip("Triton's NVIDIA backend is not installed")
    import triton

    from k3serve.ops import gemv_triton

    strides = ("stride_xb", "stride_xt", "stride_wb", "stride_wn", "stride_wk", "stride_ob", "stride_ot")
    sig = {"X": "*bf16", "W": "*bf16", "OUT": "*bf16", "PART": "*fp32", "TICKETS": "*i32",
           **{n: "i32" for n in ("T", "N", "K", *strides)}}
    consts = dict(BLOCK_T=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=4, IEEE=False, USE_PDL=True, W_STATIC=False,
                  PRELOAD=False)
    src = triton.compiler.ASTSource(fn=gemv_triton._gemv_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                                    constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3)).asm["ptx"]
    assert "wgmma" in ptx or "mma.sync" in ptx  # the tensor cores, not FMA
    assert "atom.global.gpu.acq_rel.add" in ptx and "griddepcontrol.wait" in ptx
    wait = ptx.find("griddepcontrol.wait")  # nothing touches memory before the PDL wait
    assert all(ptx.find(op) > wait for op in ("ld.global", "st.global"))
    # a static weight of one K tile a program: the weight read before the wait, nothing written
    consts.update(BLOCK_K=128, SPLIT_K=1, W_STATIC=True, PRELOAD=True)
    src = triton.compiler.ASTSource(fn=gemv_triton._gemv_kernel, signature={**sig, **{k: "constexpr" for k in consts}},
                                    constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=3)).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert 0 <= ptx.find("ld.global") < wait < ptx.find("st.global") and "st.global" not in ptx[:wait]


def test_weights_are_read_before_the_wait_only_when_static_and_one_tile():
    from k3serve.ops.gemv_triton import _preload_applies

    tile = dict(BLOCK_K=256, SPLIT_K=1, K=128)
    assert _preload_applies(dict(tile, W_STATIC=True))
    assert not _preload_applies(dict(tile, W_STATIC=False))  # an activation as the weight
    assert _preload_applies(dict(BLOCK_K=256, SPLIT_K=2, K=512, W_STATIC=True))  # one tile a split
    assert not _preload_applies(dict(BLOCK_K=256, SPLIT_K=2, K=513, W_STATIC=True))  # two tiles in a split


def test_which_linears_take_the_gemv(monkeypatch):
    """Decode-sized inputs without gradients, weights up to GEMV_MAX_WEIGHT; everything else cuBLAS."""
    import torch

    from k3serve.ops import gemv_triton as g

    taken = []
    monkeypatch.setattr(g, "triton_enabled", lambda op, device: op == "GEMV")
    monkeypatch.setattr(g, "gemv", lambda x, w, static_weight: taken.append((tuple(x.shape), static_weight))
                        or torch.nn.functional.linear(x, w))
    w = torch.randn(8, 16)
    with torch.no_grad():
        x = torch.randn(4, 16)
        assert torch.allclose(g.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        g.linear(torch.randn(2, 16).double(), w, static_weight=True)  # cast to the weight's dtype first
        g.linear(torch.randn(5, 16), w)  # too many tokens
        g.linear(torch.randn(1, 2, 16), w)  # not a token matrix
        monkeypatch.setattr(g, "GEMV_MAX_WEIGHT", 100)
        g.linear(torch.randn(1, 16), w)  # weight too large
    g.linear(torch.randn(1, 16), torch.randn(4, 16))  # gradients recorded
    assert taken == [((4, 16), False), ((2, 16), True)]


def test_batched_linear_takes_the_gemv_for_decode_batches(monkeypatch):
    """The batched GEMV's rule (few tokens, no gradients, unit K stride); the torch fallback
    multiplies in the weight's dtype and writes into ``out``."""
    import torch

    from k3serve.model.layers import batched_linear
    from k3serve.ops import gemv_triton as g

    monkeypatch.setattr(g, "triton_enabled", lambda op, device: op == "GEMV")
    w = torch.randn(2, 8, 16).bfloat16()
    with torch.no_grad():
        assert g.batched_gemv_applies(torch.randn(2, 4, 16), w)
        assert g.batched_gemv_applies(torch.randn(2, 4, 16), w.transpose(1, 2).contiguous().transpose(1, 2))
        assert not g.batched_gemv_applies(torch.randn(2, 5, 16), w)  # too many tokens
        assert not g.batched_gemv_applies(torch.randn(2, 16, 4).transpose(1, 2), w)  # x not K-contiguous
        monkeypatch.setattr(g, "BATCHED", False)
        assert not g.batched_gemv_applies(torch.randn(2, 4, 16), w)
    assert not g.batched_gemv_applies(torch.randn(2, 4, 16), w)  # gradients recorded
    x = torch.randn(2, 3, 16)
    y = batched_linear(x, w)
    ref = x.bfloat16().double() @ w.double().transpose(1, 2)
    assert y.dtype == torch.bfloat16 and torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2)
    out = torch.empty(3, 2, 8).transpose(0, 1)
    assert batched_linear(x, w, out=out) is out and torch.equal(out, y.float())

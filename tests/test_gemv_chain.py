"""bench/gemv_chain.py's kernel (the persistent-vs-per-stage GEMV chain experiment) against a
float64 chain on CPU under Triton's interpreter: per-stage launches, and the persistent form with
one program (the interpreter runs programs one after another, so a grid barrier between several
would never open; the GPU script checks the many-program form before timing it)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from bench.gemv_chain import Chain
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # ragged sizes (rows not a multiple of the chunk, K not of the tile or the first tile), several programs
    for dims, programs, tile in [([40, 72, 33, 50], 3, dict(block_n=4, block_k=16, block_kf=32)),
                                 ([64, 17, 64], 5, dict(block_n=8, block_k=32, block_kf=32)),
                                 ([30, 45, 30, 45, 30], 1, dict(block_n=16, block_k=8, block_kf=16))]:
        chain = Chain(dims, gen, torch.float32)
        x = torch.randn(dims[0], generator=gen)
        ref = chain.reference(x)
        for mode in ("pdl", "persistent"):
            if mode == "persistent" and programs > 1:
                continue
            for _ in range(2):  # twice: the persistent form must leave its counter at zero
                chain.acts[0].copy_(x)
                out = chain.run(mode, programs, **tile)
                assert chain.counter.item() == 0
                worst = max(worst, ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item())
        chain.acts[0].copy_(x)
        out = chain.run("persistent", 1, **tile)
        worst = max(worst, ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_gemv_chain_matches_float64(seed):
    assert worst_error(SCRIPT, str(seed)) < 1e-5


def test_tile_chunks_puts_each_chunk_contiguous_in_k_order():
    """The TMA forms' weight layout (gemv_chain.tile_chunks): chunk c = rows c*bn .. of the tiled
    matrix holds w[rb*bn:(rb+1)*bn, kb*bk:(kb+1)*bk] with c = rb * (K / bk) + kb; ragged shapes refused."""
    import torch

    from bench.gemv_chain import tile_chunks

    gen = torch.Generator().manual_seed(0)
    for n, k, bn, bk in [(64, 96, 16, 32), (24, 256, 8, 128), (8, 8, 8, 8)]:
        w = torch.randn(n, k, generator=gen)
        tiled = tile_chunks(w, bn, bk)
        assert tiled.shape == (n * k // bk, bk) and tiled.is_contiguous()
        n_kb = k // bk
        for rb in range(n // bn):
            for kb in range(n_kb):
                c = rb * n_kb + kb
                assert torch.equal(tiled[c * bn:(c + 1) * bn], w[rb * bn:(rb + 1) * bn, kb * bk:(kb + 1) * bk])
    with pytest.raises(ValueError, match="does not cut"):
        tile_chunks(torch.zeros(30, 64), 16, 32)

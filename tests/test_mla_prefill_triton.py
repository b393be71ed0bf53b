"""The flash-style Triton MLA prefill against the expanded reference (causal, with cached
context), on CPU through Triton's interpreter (TRITON_INTERPRET=1)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

# argv: seed, "tma" or "pointers" (how the kernel loads keys and values); each script ends by checking
# that TMA served exactly when it was on (the power-of-two head widths take it), then prints its worst error.
PRELUDE = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops import mla_prefill_triton
    from k3serve.ops.mla_prefill_triton import mla_prefill, mla_prefill_varlen
    from k3serve.ops.mla_ref import mla_expanded_ref
    mla_prefill_triton.TMA_LOADS = sys.argv[2] == "tma"
    served, taken = mla_prefill_triton.tma_loads, []
    mla_prefill_triton.tma_loads = lambda *views: taken.append(served(*views)) or taken[-1]
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
''')
EPILOGUE = textwrap.dedent('''
    assert any(taken) == (sys.argv[2] == "tma"), taken
    print(worst)
''')

SCRIPT = PRELUDE + textwrap.dedent('''
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
''') + EPILOGUE


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("loads", ["pointers", "tma"])
def test_flash_prefill_matches_reference(seed, loads):
    """Fresh prompts and chunks on cached context, head widths powers of two or not (those take the
    pointer loads), keys and values loaded by pointers or by TMA (``TMA_LOADS``)."""
    assert worst_error(SCRIPT, str(seed), loads) < 1e-5


VARLEN_SCRIPT = PRELUDE + textwrap.dedent('''
    for Ha, dn, dr, dv, rkv, layout in [(2, 32, 16, 32, 64, [(0, 37), (45, 20), (7, 1), (0, 70)]),
                                        (3, 24, 4, 40, 32, [(100, 3)]), (1, 16, 16, 32, 32, [(3, 17), (0, 16)])]:
        scale = (dn + dr) ** -0.5
        w = torch.randn(Ha * (dn + dv), rkv, generator=gen) / rkv ** 0.5
        qs = [torch.randn(t, Ha, dn + dr, generator=gen) for _, t in layout]
        lats = [torch.randn(c + t, rkv + dr, generator=gen) for c, t in layout]
        rows, q0, k0 = [], 0, 0
        for (c, t), lat in zip(layout, lats):
            rows.append([q0, k0, c, t])
            q0, k0 = q0 + t, k0 + lat.shape[0]
        seqs = torch.tensor(rows, dtype=torch.int32)
        ref = torch.cat([mla_expanded_ref(q, lat, w, c, rkv, dn, scale) for q, lat, (c, _) in zip(qs, lats, layout)])
        for tiles in (dict(BLOCK_M=16, BLOCK_N=16), None):
            out = mla_prefill_varlen(torch.cat(qs), torch.cat(lats), w, seqs, max(t for _, t in layout), rkv, dn,
                                     scale, tiles=tiles)
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
''') + EPILOGUE


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("loads", ["pointers", "tma"])
def test_varlen_flash_prefill_matches_reference_per_sequence(seed, loads):
    """Many sequences in one launch (each with its own cached context, new tokens from 1 to 70,
    a shorter one's spare query blocks idle) equal the reference run on each alone; with TMA each
    program's descriptors end at its sequence's last key."""
    assert worst_error(VARLEN_SCRIPT, str(seed), loads) < 1e-5


GLUE_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model import mla
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.presets import preset_config
    mla.triton_enabled = lambda op, device: True  # the GPU path's Triton kernels, interpreted
    from k3serve.config import ModelConfig
    cfg = ModelConfig.from_dict(preset_config("tiny"))
    torch.manual_seed(int(sys.argv[1]))
    mixer = mla.MLAMixer(cfg, torch.float32)
    for p in mixer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    mixer.eval()
    # decodes first (with context), then prompts: new, with cached context, one token after context
    layout = [(1, 40), (1, 3), (30, 0), (17, 70), (45, 0), (2, 130)]
    chunks = [SeqChunk([0] * q, c, i, list(range(4 * i, 4 * i + 4))) for i, (q, c) in enumerate(layout)]
    batch = ForwardBatch.build(chunks, 64, "cpu")
    W = mixer.rkv + mixer.rope
    pages = torch.randn(24, 64, W)
    q = torch.randn(batch.num_tokens, mixer.num_heads, mixer.nope + mixer.rope)
    with torch.no_grad():
        mla.VARLEN_PREFILL = False
        per_seq = mixer.attend(q, batch, pages)
        mla.VARLEN_PREFILL = True
        other = mixer.attend(q, batch, pages)
    print(((other - per_seq).norm() / per_seq.norm()).item())
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_mla_layer_varlen_prefill_equals_per_prompt(seed):
    """``mla.VARLEN_PREFILL``: an MLA layer's attention over a mixed step (decodes, new prompts,
    prompts on cached context, one new token on context) through one varlen launch, the latents
    gathered by the step's ``ForwardBatch.prefill_latents``, equals the per-prompt launches (both
    the GPU path's kernels, interpreted)."""
    assert worst_error(GLUE_SCRIPT, str(seed)) < 1e-6


OUT_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.mla_prefill_triton import mla_prefill, mla_prefill_varlen
    gen = torch.Generator().manual_seed(0)
    Ha, dn, dr, dv, rkv = 2, 32, 16, 32, 64
    q = torch.randn(30, Ha, dn + dr, generator=gen)
    latent = torch.randn(50, rkv + dr, generator=gen)
    w = torch.randn(Ha * (dn + dv), rkv, generator=gen) / rkv ** 0.5
    tiles = dict(BLOCK_M=16, BLOCK_N=16)
    fp32 = mla_prefill(q, latent, w, 20, rkv, dn, dn ** -0.5, tiles=tiles)
    def rounded_once(got, dtype):  # (the interpreter's bf16 rounding may differ from torch's by an ulp)
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
        return bool(((got.float() - fp32).abs() <= fp32.abs() * ulp).all())
    for dtype in (torch.bfloat16, torch.float32):
        whole = torch.full((33, Ha, dv), 7.0, dtype=dtype)
        got = mla_prefill(q, latent, w, 20, rkv, dn, dn ** -0.5, tiles=tiles, out=whole[3:])
        assert got.data_ptr() == whole[3:].data_ptr() and bool((whole[:3] == 7).all())
        assert rounded_once(whole[3:], dtype), (whole[3:].float() - fp32).abs().max()
    seqs = torch.tensor([[0, 0, 20, 30]], dtype=torch.int32)
    whole = torch.full((31, Ha, dv), 7.0, dtype=torch.bfloat16)
    mla_prefill_varlen(q, latent, w, seqs, 30, rkv, dn, dn ** -0.5, tiles=tiles, out=whole[1:])
    assert rounded_once(whole[1:], torch.bfloat16) and bool((whole[0] == 7).all())
    try:
        mla_prefill(q, latent, w, 20, rkv, dn, dn ** -0.5, tiles=tiles, out=torch.empty(30, Ha, dv + 1))
    except ValueError as exc:
        assert "out must be [30, 2, 32]" in str(exc), exc
    else:
        raise AssertionError("a wrongly shaped out was accepted")
    print(0.0)
''')


def test_prefill_writes_into_a_given_output_in_its_dtype():
    """``out=``: the fp32 result rounded once into the caller's buffer (a row slice of the layer's
    output, bf16 or fp32), rows outside it untouched; a wrongly shaped buffer is refused."""
    assert worst_error(OUT_SCRIPT) == 0.0

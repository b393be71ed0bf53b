"""The fused Triton AttnRes mixer against the module + RMSNorm reference, on CPU through Triton's
interpreter (TRITON_INTERPRET=1)."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.attn_res import AttnResMixer
    from k3serve.model.layers import rms_norm
    from k3serve.ops import attn_res_triton
    from k3serve.ops.attn_res_triton import attn_res_mix
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    # a program a token: the whole row in one chunk, then (a small TILE) several chunks, the last
    # one part padding; pass 1's last chunk reused in pass 2 (few tokens, up to 8 blocks) or read
    # again (16 / 130). Then (split) a few tokens' rows split between programs of 32 columns.
    cases = [(1, 3, 64), (2, 5, 96), (5, 7, 128), (9, 4, 200), (16, 2, 300), (3, 130, 64)]
    for split, tile, (M, T, D) in ([(False, 16384, c) for c in cases] + [(False, 64, c) for c in cases] +
                                   [(True, 16384, c) for c in cases]):
        attn_res_triton.TILE = attn_res_triton.TILE_FEW_TOKENS = tile
        attn_res_triton.SPLIT_TOKENS, attn_res_triton.SPLIT_MIN_COLS = (32, 32) if split else (0, 256)
        attn_res_triton.SPLIT_MIN_SOURCES = 1
        shape = attn_res_triton.launch_shape(M, D, T)
        assert (shape["N_CHUNKS"] > 1) == (tile == 64), shape
        programs = attn_res_triton.split_shape(M, D, T, torch.device("cpu"))
        assert (programs is not None) == (split and T <= 32), programs
        assert programs is None or programs["SPLIT"] == -(-D // 32)
        mixer = AttnResMixer(D, 1e-5, torch.float32)
        mixer.proj.data.copy_(torch.randn(1, D, generator=gen))
        mixer.norm.data.copy_(torch.rand(D, generator=gen) + 0.5)
        out_w = torch.rand(D, generator=gen) + 0.5
        src = [torch.randn(T, D, generator=gen) * (i + 1) for i in range(M)]
        ref = rms_norm(mixer(src), out_w, 1e-5, torch.float32)
        got = attn_res_mix(torch.stack(src), mixer.folded_query(), 1e-5, out_w)
        worst = max(worst, ((got - ref).norm() / ref.norm()).item())
        ref_final = mixer(src)  # the final mixer has no output norm
        got_final = attn_res_mix(torch.stack(src), mixer.folded_query(), 1e-5, None)
        worst = max(worst, ((got_final - ref_final).norm() / ref_final.norm()).item())
        mixer.fold_query()  # folded once (serving): the same mix, straight into a bf16 output
        got_bf16 = attn_res_mix(torch.stack(src), mixer.folded_query(), 1e-5, out_w.bfloat16(), torch.bfloat16)
        assert got_bf16.dtype == torch.bfloat16
        ref_bf16 = rms_norm(mixer(src), out_w.bfloat16(), 1e-5, torch.float32)
        assert ((got_bf16.float() - ref_bf16).norm() / ref_bf16.norm()).item() < 8e-3  # one bf16 rounding
        # the partial's pending update done in the pass: the buffer and the output bit for bit those
        # of the update done first. (The interpreter rounds fp32 -> bf16 toward zero where the GPU
        # and torch round to nearest: the reference here truncates too; bench/gpu_check_kernels.py
        # checks the GPU against torch's add.)
        buf = torch.stack(src).bfloat16()
        ref_buf = rms_norm(mixer(list(buf.float())), out_w, 1e-5, torch.float32)  # bf16 sources, fp32 output
        got_buf = attn_res_mix(buf, mixer.folded_query(), 1e-5, out_w)
        worst = max(worst, ((got_buf - ref_buf).norm() / ref_buf.norm()).item())
        delta = torch.randn(T, D, generator=gen).bfloat16()
        for reset in (False, True):
            first = buf.clone()
            summed = delta.float() + (0 if reset else first[-1].float())
            first[-1] = (summed.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)  # truncated
            expect = attn_res_mix(first, mixer.folded_query(), 1e-5, out_w, torch.bfloat16)
            fused = buf.clone()
            got = attn_res_mix(fused, mixer.folded_query(), 1e-5, out_w, torch.bfloat16, (delta, reset))
            assert torch.equal(fused, first) and torch.equal(got, expect), (M, reset)
    print(worst)
''')


def test_fused_mixer_matches_reference():
    assert worst_error(SCRIPT) < 1e-5


SUMMARY_SCRIPT = textwrap.dedent('''
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.attn_res import AttnResMixer, block_summary, summary_mix
    from k3serve.model.layers import rms_norm
    from k3serve.ops import attn_res_triton
    from k3serve.ops.attn_res_triton import attn_res_mix, attn_res_summary
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    attn_res_triton.SPLIT_MIN_COLS = 32  # (several programs a row at these widths)

    def truncated(x):  # the interpreter rounds fp32 -> bf16 toward zero
        return (x.float().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)

    for M, T, D, Q in [(1, 1, 64, 3), (5, 2, 96, 24), (9, 4, 200, 19), (16, 3, 300, 32)]:
        mixers = [AttnResMixer(D, 1e-5, torch.float32) for _ in range(Q)]
        for mixer in mixers:
            mixer.proj.data.copy_(torch.randn(1, D, generator=gen))
            mixer.norm.data.copy_(torch.rand(D, generator=gen) + 0.5)
        queries = torch.stack([mixer.folded_query() for mixer in mixers])
        out_w = torch.rand(D, generator=gen) + 0.5
        blocks = torch.stack([torch.randn(T, D, generator=gen) * (i + 1) for i in range(M)]).bfloat16()
        delta = torch.randn(T, D, generator=gen).bfloat16()
        # the block's first mixer, the last block's pending update done in the pass
        summary, logits = torch.empty(Q, T, 2, D, dtype=torch.bfloat16), torch.empty(Q, T)
        buf = blocks.clone()
        first = attn_res_summary(buf, queries, 1e-5, out_w, torch.float32, (delta, False), summary, logits)
        blocks[-1] = truncated(delta.float() + blocks[-1].float())
        assert torch.equal(buf, blocks)
        ref_summary, ref_logits = block_summary(blocks.float(), queries, 1e-5)
        worst = max(worst, ((summary.float().sum(-2) - ref_summary).norm() / ref_summary.norm()).item(),
                    ((logits - ref_logits).norm() / ref_logits.norm()).item())
        ref = rms_norm(mixers[0](list(blocks.float())), out_w, 1e-5, torch.float32)
        worst = max(worst, ((first - ref).norm() / ref.norm()).item())
        # later mixers: their summary row and the partial (its update, add or reset, in the pass)
        partial = torch.randn(1, T, D, generator=gen).bfloat16()
        for j in (1, Q - 1):
            for reset in (False, True):
                buf = partial.clone()
                updated = truncated(delta.float() + (0 if reset else partial[0].float()))
                ref = rms_norm(mixers[j]([*blocks.float(), updated.float()]), out_w, 1e-5, torch.float32)
                got = attn_res_mix(buf, queries[j], 1e-5, out_w, torch.float32, (delta, reset), (summary[j], logits[j]))
                assert torch.equal(buf[0], updated)
                worst = max(worst, ((got - ref).norm() / ref.norm()).item())
            final = attn_res_mix(partial, queries[j], 1e-5, None, torch.float32, None, (summary[j], logits[j]))
            ref = mixers[j]([*blocks.float(), partial[0].float()])
            torch_path = summary_mix(summary[j], logits[j], partial[0].float(), queries[j], 1e-5)
            worst = max(worst, ((final - ref).norm() / ref.norm()).item(), ((torch_path - ref).norm() / ref.norm()).item())
    print(worst)
''')


def test_block_summary_and_its_mixers_match_reference():
    """``attn_res_summary`` (a block's first mixer and the blocks mixed for each of the block's
    queries, through the split kernel's two phases) and ``attn_res_mix`` over a summary row and
    the partial, against the mixers over all sources. The summary's high and low bf16 parts keep
    2^-16 of it (truncated here), hence the bound."""
    assert worst_error(SUMMARY_SCRIPT) < 3e-5

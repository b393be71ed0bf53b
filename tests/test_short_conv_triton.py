"""The varlen short-conv kernel (two launches) against the torch reference, through Triton's
interpreter: decode rows, fresh prefills, prefills on cached context shorter and longer than the
window, strided inputs and a strided state pool, q/k/v planes."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    import torch.nn.functional as F
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.batch import ForwardBatch, SeqChunk
    from k3serve.ops.kda_ref import l2norm
    from k3serve.ops.short_conv import short_conv_ref
    from k3serve.ops import short_conv_triton as m
    from k3serve.ops.short_conv_triton import short_conv_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    m.CONV_CHANNELS_FIRST, m.CONV_ROWS, m.CONV_BLOCK_C = sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    m.CONV_GROUP = int(sys.argv[5])
    worst = 0.0
    for C, W, plane, dtype, shape in [(96, 4, 32, torch.float32, [(1, 5), (1, 9), (7, 0), (2, 3), (40, 11)]),
                                      (80, 4, None, torch.float32, [(3, 1), (1, 2), (1, 0), (33, 0)]),
                                      (64, 3, 16, torch.bfloat16, [(1, 4), (5, 2), (1, 1), (2, 0), (70, 6)]),
                                      (144, 4, 48, torch.bfloat16, [(1, 3), (37, 0), (2, 5)]),
                                      (48, 4, 16, torch.float32, [(9, 0), (1, 2), (6, 4)]),
                                      (32, 4, 16, torch.float32, [(2, 3), (5, 1), (8, 0)])]:
        slots = 9
        chunks, perm = [], torch.randperm(slots - 1, generator=gen)[: len(shape)].tolist()
        for (q, ctx), slot in zip(shape, perm):
            chunks.append(SeqChunk(list(range(q)), ctx, slot, list(range(-(-(q + ctx) // 16)))))
        batch = ForwardBatch.build(chunks, 16)
        T = batch.num_tokens
        wide = torch.randn(T, C + 7, generator=gen).to(dtype)
        x = wide[:, 3:3 + C]  # rows strided, channels dense (a split of a fused GEMM's output)
        weight = torch.randn(C, W, generator=gen)
        # (the last case: a bf16 state under fp32 inputs, which the outputs must not see rounded)
        pool = torch.randn(slots, C + 2, W + 1, generator=gen).to(torch.bfloat16 if C == 32 else dtype)
        state = pool[:, 1:1 + C, 1:W]  # a strided per-layer view, as the unified pool hands out
        state_ref, state_before = state.clone(), state.clone()
        ref = F.silu(short_conv_ref(x, weight, state_ref, batch).float())
        planes = short_conv_triton(x, weight, state, batch, silu=True, plane=plane)
        p = plane or C
        assert planes.shape == (C // p, T, p) and planes.is_contiguous()
        out = planes.transpose(0, 1).reshape(T, C).float()
        tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7
        worst = max(worst, ((out - ref).norm() / ref.norm()).item() / tol)
        if state.dtype == x.dtype:
            assert torch.equal(state, state_ref), "conv states differ"  # copies of inputs: exact
        else:  # a rounding of each input (the interpreter's fp32 -> bf16 casts truncate; torch's round)
            assert torch.allclose(state.float(), state_ref.float(), rtol=2.0 ** -7, atol=0), "conv states differ"
        untouched = [s for s in range(slots) if s not in perm[: len(shape)]]
        assert torch.equal(pool[untouched, 1:1 + C, 1:W], state_ref[untouched])
        for head in [h for h in (16, 24, 48) if plane and plane % h == 0]:
            # q and k (the first two planes) L2-normalised per head, as KDA's conv may; a head of 24
            # fills 24 lanes of a 32-wide tile, one of 48 (the bundled tiny model's KDA heads) 48 of 64
            normed = short_conv_triton(x, weight, state_before.clone(), batch, silu=True, plane=plane,
                                       norm=(2 * plane, head))  # (from the states before: each call updates them)
            heads = ref[:, :2 * plane].unflatten(1, (-1, head))
            ref_n = torch.cat([l2norm(heads).flatten(1), ref[:, 2 * plane:]], 1)
            out_n = normed.transpose(0, 1).reshape(T, C).float()
            worst = max(worst, ((out_n - ref_n).norm() / ref_n.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed, channels_first, rows, block_c, group", [
    (0, "0", "32", "1024", "8"), (1, "0", "8", "64", "8"), (0, "1", "32", "128", "4"), (1, "1", "4", "32", "2")])
def test_short_conv_kernel_matches_reference(seed, channels_first, rows, block_c, group):
    """Programs in channel-block-first order or not; programs of 4 / 8 rows that hold several
    sequences and their starts (a decode row, a window cut by a sequence start, a short prompt
    whose whole output comes from the heads kernel) or 32 of a long prompt's state-free interior;
    channel tiles of 1,024 lanes (one for all channels), or of 32-128 (several a row, and heads of
    16 / 24 / 48 grouped 1-4 a tile for the norm); rows loaded 2-8 at a time."""
    assert worst_error(SCRIPT, str(seed), channels_first, rows, block_c, group) < 1.0  # error over each case's tolerance

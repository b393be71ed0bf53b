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
        # also page-major (a static step's table: its used pages one contiguous run); same pages
        table_t = torch.empty(B * max_pages, dtype=table.dtype).as_strided((B, max_pages), (1, B)).copy_(table)
        seq_lens = torch.tensor(lens)
        q = torch.randn(B, H, width, generator=gen)
        scale = 0.11
        out = mla_decode(q, latent, table, seq_lens, rkv, scale, num_splits=splits)
        # the same query as a strided absorbed part and a separate q_pe (the model's decode call)
        q_c = torch.cat([q[..., :rkv], torch.zeros(B, H, 3)], -1)[..., :rkv].transpose(0, 1).contiguous().transpose(0, 1)
        out_split = mla_decode(q_c, latent, table, seq_lens, rkv, scale, num_splits=splits, q_pe=q[..., rkv:])
        assert torch.allclose(out_split, out, atol=1e-6), "q_pe apart differs"
        assert torch.equal(mla_decode(q, latent, table_t, seq_lens, rkv, scale, num_splits=splits), out), \
            "a page-major table differs"
        # key tiles as wide as a page, a quarter of one, and wider (page-local vs per-row addressing)
        for bn in (16, 64):
            tiled = mla_decode(q, latent, table, seq_lens, rkv, scale, num_splits=splits,
                               tiles=dict(BLOCK_H=16, BLOCK_N=bn, num_warps=4, num_stages=1))
            assert torch.allclose(tiled, out, atol=1e-5), f"BLOCK_N={bn} differs"
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


MERGE_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.mla_decode_triton import merge_splits
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for B, H, S, C in [(1, 32, 64, 512), (3, 4, 5, 48), (2, 3, 1, 200)]:  # (S = 1: nothing to merge)
        partial = torch.randn(B, H, S + 2, C, generator=gen)[:, :, 1:S + 1]  # strided splits
        lse = torch.randn(B, H, S, generator=gen) * 3
        if S > 2:  # empty splits (-inf; their rows never written: garbage) weigh nothing
            lse[0, :, 1] = float("-inf")
            partial[0, :, 1] = float("nan")
        ref = torch.einsum("bhs,bhsc->bhc", torch.softmax(lse.double(), -1), partial.double())
        out = merge_splits(partial, lse)
        assert out.shape == (B, H, C) and out.dtype == torch.float32 and not out.isnan().any()
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_merge_by_their_log_sum_exp(seed):
    """The split outputs' merge (one PDL launch) against softmax(lse)-weighted sums in float64."""
    assert worst_error(MERGE_SCRIPT, str(seed)) < 1e-6


def test_split_count_follows_the_gluon_forms_head_block():
    """Programs are counted by the heads each takes: the Gluon step runs 64 heads a program from
    HEADS_MAJOR_MIN heads (K3's 96: two head blocks, not three), so the split count that fills the
    GPU doubles there; below it, and for the Triton kernel, heads go by 32."""
    import torch

    from k3serve.ops import mla_decode_gluon
    from k3serve.ops.mla_decode_triton import default_num_splits, num_splits_for, split_head_block

    assert [split_head_block(h, True) for h in (16, 32, 63, 64, 96, 128)] == [32, 32, 32, 64, 64, 64]
    assert [split_head_block(h, False) for h in (32, 96)] == [32, 32]
    # 16 sequences of 96 heads on 132 SMs, 32K tokens: ~2 waves of (sequence, head block, split)
    assert default_num_splits(16, 96, 32768, 132, split_head_block(96, False)) == 4  # 3 blocks: 192 programs
    assert default_num_splits(16, 96, 32768, 132, split_head_block(96, True)) == 8  # 2 blocks: 256 programs
    cpu = torch.device("cpu")  # (an H200's 132 SMs off the GPU)
    assert (num_splits_for(16, 96, 32768, cpu, True), num_splits_for(16, 96, 32768, cpu, False)) == (8, 4)
    saved = mla_decode_gluon.HEADS_MAJOR_MIN
    try:
        mla_decode_gluon.HEADS_MAJOR_MIN = None
        assert split_head_block(96, True) == 32
    finally:
        mla_decode_gluon.HEADS_MAJOR_MIN = saved


@pytest.mark.parametrize("preset", ["kimi-linear-48b", "k3"])
def test_pool_pages_take_the_seesaw_tma_ring(preset):
    """The seesaw step's TMA ring addresses the cache as one [rows, 576] tensor map: the pool's MLA
    views (every layer's rows of a page in one run, units padded to 256 bytes) must qualify, or the
    served path falls back to cp.async unseen; its rows end at the last page's last row, inside the
    buffer. A view whose pages are not a whole number of rows apart does not qualify."""
    import torch

    from k3serve.cache.pool import PoolLayout, UnifiedPool
    from k3serve.config import ModelConfig
    from k3serve.ops import mla_decode_gluon
    from k3serve.presets import preset_config

    cfg = ModelConfig.from_dict(preset_config(preset))
    lay = PoolLayout.for_model(cfg, torch.bfloat16)
    pool = UnifiedPool(cfg, lay.slot_bytes + 3 * lay.page_bytes + 4096, torch.bfloat16)
    width = cfg.mla_cache_width
    for layer in (0, cfg.num_mla_layers - 1):
        view = pool.handles.mla[layer].latent
        assert mla_decode_gluon.tma_ring_applies(view)
        desc = mla_decode_gluon._ring_descriptor(view)
        assert desc.shape == [(view.shape[0] - 1) * view.stride(0) // width + view.shape[1], width]
        end = view.data_ptr() + desc.shape[0] * width * view.element_size()
        assert end <= pool.buffer.data_ptr() + pool.buffer.numel()
        assert view[-1, -1].data_ptr() + width * view.element_size() == end  # the last page's last row
    odd = torch.zeros(3 * (64 * width + 8), dtype=torch.bfloat16).as_strided((3, 64, width), (64 * width + 8, width, 1))
    assert not mla_decode_gluon.tma_ring_applies(odd)
    saved = mla_decode_gluon.SEESAW_TMA
    try:
        mla_decode_gluon.SEESAW_TMA = False
        assert not mla_decode_gluon.tma_ring_applies(pool.handles.mla[0].latent)
    finally:
        mla_decode_gluon.SEESAW_TMA = saved

"""The unified two-ended pool: packing, compaction moves, views, static split."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3serve.cache.pool import PoolFull, UnifiedPool, parse_bytes
from k3serve.config import ModelConfig
from k3serve.presets import preset_config

CFG = ModelConfig.from_dict(preset_config("tiny"))


def make_pool(units=12, **kw):
    probe = UnifiedPool(CFG, 1 << 24, torch.float32)
    lay = probe.layout
    return UnifiedPool(CFG, units * max(lay.slot_bytes, lay.page_bytes), torch.float32, **kw)


def test_layout_sizes():
    pool = make_pool()
    lay = pool.layout
    H, D = CFG.kda_num_heads, CFG.kda_head_dim
    assert lay.recurrent_bytes == H * D * D * 4
    assert lay.conv_bytes == 3 * H * D * (CFG.kda_conv_size - 1) * 4
    assert lay.slot_bytes >= CFG.num_kda_layers * (lay.recurrent_bytes + lay.conv_bytes)
    assert lay.page_bytes >= CFG.num_mla_layers * 64 * CFG.mla_cache_width * 4


def test_two_ends_share_the_middle():
    pool = make_pool()
    slots = [pool.alloc_slot() for _ in range(3)]
    pages = [pool.alloc_page() for _ in range(4)]
    assert slots == [0, 1, 2]
    assert pages == [pool.page_capacity - 1 - i for i in range(4)]
    # fill the middle with pages only, then no slot fits; free a page and one does (if sizes allow)
    while pool.can_allocate(pages=1):
        pool.alloc_page()
    with pytest.raises(PoolFull):
        pool.alloc_page()
    assert not pool.can_allocate(slots=1) or pool.layout.slot_bytes <= pool.free_bytes


def test_views_address_the_right_bytes():
    pool = make_pool()
    s0, s1 = pool.alloc_slot(), pool.alloc_slot()
    p0, p1 = pool.alloc_page(), pool.alloc_page()
    h = pool.handles
    h.kda[1].recurrent[s1].fill_(3.0)
    h.kda[0].conv[s1].fill_(5.0)
    h.mla[1].latent[p0].fill_(7.0)
    assert pool.slot_bytes_of(s0).count_nonzero() == 0 and pool.page_bytes_of(p1).count_nonzero() == 0
    b = pool.slot_bytes_of(s1).view(torch.float32)
    assert (b == 3.0).sum() == CFG.kda_num_heads * CFG.kda_head_dim ** 2
    assert (b == 5.0).sum() == 3 * CFG.kda_proj_size * (CFG.kda_conv_size - 1)
    assert (pool.page_bytes_of(p0).view(torch.float32) == 7.0).sum() == 64 * CFG.mla_cache_width


def test_free_moves_the_last_unit_into_the_hole():
    pool = make_pool()
    for _ in range(3):
        pool.alloc_slot()
    pool.handles.kda[0].recurrent[2].fill_(9.0)
    assert pool.free_slot(0) == (2, 0)
    assert (pool.handles.kda[0].recurrent[0] == 9.0).all() and pool.num_slots == 2
    pages = [pool.alloc_page() for _ in range(3)]
    pool.handles.mla[0].latent[pages[-1]].fill_(4.0)
    assert pool.free_page(pages[0]) == (pages[-1], pages[0])
    assert (pool.handles.mla[0].latent[pages[0]] == 4.0).all()
    assert pool.free_page(pages[1]) is None  # the outermost page leaves no hole


def test_static_split_refuses_what_unified_admits():
    unified, static = make_pool(), make_pool(kda_fraction=0.25)
    n_u = n_s = 0
    while unified.can_allocate(slots=1):
        unified.alloc_slot()
        n_u += 1
    while static.can_allocate(slots=1):
        static.alloc_slot()
        n_s += 1
    assert n_s < n_u
    assert static.num_slots * static.layout.slot_bytes <= static.total_bytes * 0.25


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1.5GB") == 1_500_000_000
    with pytest.raises(ValueError, match="byte size"):
        parse_bytes("lots")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["slot", "page", "free_slot", "free_page"]), st.integers(0, 10 ** 6)),
                max_size=80))
def test_random_interleavings_keep_regions_packed_and_bytes_intact(ops):
    pool = make_pool(units=10)
    owners = {"slot": {}, "page": {}}  # id -> marker value written into the unit
    marker = 1.0
    for op, r in ops:
        kind = op.split("_")[-1]
        if op in ("slot", "page"):
            if not pool.can_allocate(**{kind + "s": 1}):
                with pytest.raises(PoolFull):
                    pool.alloc_slot() if kind == "slot" else pool.alloc_page()
                continue
            uid = pool.alloc_slot() if kind == "slot" else pool.alloc_page()
            assert uid not in owners[kind]
            (pool.slot_bytes_of(uid) if kind == "slot" else pool.page_bytes_of(uid)).view(torch.float32).fill_(marker)
            owners[kind][uid] = marker
            marker += 1
        elif owners[kind]:
            uid = sorted(owners[kind])[r % len(owners[kind])]
            moved = pool.free_slot(uid) if kind == "slot" else pool.free_page(uid)
            owners[kind].pop(uid)
            if moved is not None:
                old, new = moved
                owners[kind][new] = owners[kind].pop(old)
        # invariants: packed regions, no overlap, every live unit keeps its bytes
        assert sorted(owners["slot"]) == list(range(pool.num_slots))
        assert sorted(owners["page"]) == list(range(pool.page_capacity - pool.num_pages, pool.page_capacity))
        assert pool.num_slots * pool.layout.slot_bytes <= pool.page_base + (pool.page_capacity - pool.num_pages) * pool.layout.page_bytes
        for uid, m in owners["slot"].items():
            assert (pool.slot_bytes_of(uid).view(torch.float32) == m).all()
        for uid, m in owners["page"].items():
            assert (pool.page_bytes_of(uid).view(torch.float32) == m).all()
    for uid in sorted(owners["slot"], reverse=True):
        pool.free_slot(uid)
    for uid in sorted(owners["page"]):
        moved = pool.free_page(uid)
        assert moved is None
    assert pool.used_bytes == 0 and pool.num_slots == 0 and pool.num_pages == 0

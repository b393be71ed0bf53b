"""The Triton grouped expert GEMM (bf16 and MXFP4-in-register weights) against the reference MoE,
on CPU through Triton's interpreter (TRITON_INTERPRET=1); GPU timing lives in bench/."""

import textwrap

import pytest

pytest.importorskip("triton")

from interpreted import worst_error  # noqa: E402

SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.config import ModelConfig
    from k3serve.model.loader import load_model
    from k3serve.ops.moe_ref import experts_ref
    from k3serve.ops.expert_sort import sort_by_expert
    from k3serve.ops import moe_triton
    from k3serve.ops.moe_triton import experts_triton
    mx = "mxfp4" in sys.argv[1]
    if len(sys.argv) > 2:  # the weighted expert rows in the activation dtype from this many assignments
        moe_triton.ROWS_IN_ACTIVATION_DTYPE_FROM = int(sys.argv[2])
    if sys.argv[1].startswith("bundled"):  # latent 96, expert width 64: tiles of 32 along K
        from k3serve.bundled import resolve_model
        model = load_model(resolve_model("tiny-mxfp4" if mx else "tiny"), dtype="float32", device="cpu")
    else:  # "-bf16": bf16 activations, the tl.dot_scaled MXFP4 path, against an fp32 reference
        bf16 = sys.argv[1].endswith("bf16")
        model = load_model(preset="tiny", dtype="bfloat16" if bf16 else "float32", device="cpu", seed=3, mxfp4=mx)
    moe = model.model.layers[1].block_sparse_moe
    expert_fp32 = lambda e: tuple(t.float() for t in moe.experts.expert(e))
    if sys.argv[1].endswith("silu"):  # Kimi-Linear's SiLU-GLU instead of K3's SiTU-GLU
        moe.experts.act = ("silu", 1.0, None)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for T, bm in ((1, 16), (5, 16), (23, 16), (23, 64)):  # 64: the prefill row blocks
        x = torch.randn(T, moe.experts.w1_packed.shape[-1] * 2 if mx else moe.experts.w1.shape[-1], generator=gen)
        x = x.to(moe.experts.dtype)
        w, ids = moe.gate(torch.randn(T, model.config.hidden_size, generator=gen).to(moe.experts.dtype))
        ref = experts_ref(x.float(), w, ids, expert_fp32, *moe.experts.act)
        # the bundled model takes the default path (autotuned tile; one config when interpreted);
        # the others both orientations of the MMA (weights as its M side or as its N side), and
        # at 23 tokens in row blocks of 16 a K tile of 32 instead of the widest (64)
        tiles = {} if sys.argv[1].startswith("bundled") else dict(
            block_m=bm, tiles=dict(BLOCK_N=32, SWAP_AB=T != 1 and bm == 16, **({"BLOCK_K": 32} if T == 23 and bm == 16
                                                                               else {})))
        out = experts_triton(x, w, ids, moe.experts, **tiles)
        worst = max(worst, ((out - ref).norm() / ref.norm()).item())
        rows, blocks = sort_by_expert(ids, moe.experts.num_experts, 16)
        real = rows[rows < ids.numel()]
        assert sorted(real.tolist()) == list(range(ids.numel()))  # every assignment exactly once
        flat = ids.flatten()
        for b in range(len(blocks)):
            r = rows[b * 16:(b + 1) * 16]
            r = r[r < ids.numel()]
            assert (flat[r] == blocks[b]).all()  # a row block holds one expert's rows
    print(worst)
''')


@pytest.mark.parametrize("fmt", ["dense", "mxfp4", "dense-silu", "bundled", "bundled-mxfp4"])
def test_grouped_gemm_matches_reference(fmt):
    """fp32 activations and weights (MXFP4 decoded exactly): the reference's arithmetic."""
    assert worst_error(SCRIPT, fmt) < 1e-5


def test_grouped_gemm_bf16_matches_fp32_reference():
    """bf16 activations (MXFP4 through tl.dot_scaled): within bf16 rounding of the fp32
    reference on the same weights (the GLU output is stored in bf16 between the two GEMMs).
    Dense bf16 weights are not checked here: Triton 3.9's interpreter returns garbage for a plain
    tl.dot of two bf16 tiles (relative error ~1e10 on a 16x64 @ 64x32 product whose loads read
    back exactly), so that path is checked on the GPU by bench/kernels_moe.py."""
    err = worst_error(SCRIPT, "mxfp4-bf16")
    assert err < 1.5e-2, err


def test_expert_rows_in_the_activation_dtype_sum_like_fp32_rows():
    """Prefill's weighted expert rows stored in bf16 (``ROWS_IN_ACTIVATION_DTYPE_FROM``: here from 20
    assignments, so 5 tokens keep fp32 rows and 23 take bf16 ones) and summed in fp32 by the combine:
    within bf16 rounding of the fp32 reference, as the fp32 rows are."""
    err = worst_error(SCRIPT, "mxfp4-bf16", "20")
    assert err < 1.5e-2, err


ALIGN_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.expert_sort import sort_by_expert, sort_by_expert_torch
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    for T, k, E, bm in [(1, 8, 256, 16), (5, 4, 16, 16), (37, 8, 64, 16), (300, 2, 7, 32), (3, 1, 8, 16)]:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        rows, blocks = sort_by_expert(ids, E, bm)
        ref_rows, ref_blocks = sort_by_expert_torch(ids, E, bm)
        assert rows.shape == ref_rows.shape and torch.equal(blocks, ref_blocks), (T, E)
        for b in range(len(blocks)):  # same rows in every block (their order inside may differ)
            got, want = rows[b * bm:(b + 1) * bm].sort().values, ref_rows[b * bm:(b + 1) * bm].sort().values
            assert torch.equal(got, want), (T, E, b)
    print(0.0)
''')


@pytest.mark.parametrize("sizes", [(16,), (16, 32, 128), (32, 64, 128), (16, 64)])
def test_mixed_size_row_blocks_hold_each_assignment_once(sizes):
    """``sort_by_expert_sizes``: each expert's rows as whole blocks of the largest size, then one
    tail block of the smallest size that holds the rest; every assignment in exactly one block,
    of its expert; valid rows lead each block (the GEMMs skip a block whose first row is padding)."""
    import torch

    from k3serve.ops.expert_sort import sort_by_expert_sizes

    gen = torch.Generator().manual_seed(len(sizes))
    T, k, E = 300, 4, 9
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=E)
    seen = torch.zeros(T * k, dtype=torch.int64)
    blocks_of = torch.zeros(E, len(sizes), dtype=torch.int64)
    for i, (bm, rows, owners) in enumerate(sort_by_expert_sizes(ids, E, sizes)):
        assert bm == sizes[i] and rows.numel() == owners.numel() * bm
        for b, block in enumerate(rows.view(-1, bm)):
            valid = block < T * k
            assert torch.equal(valid, torch.arange(bm) < valid.sum())  # valid rows lead
            assert (ids.flatten()[block[valid]] == owners[b]).all()
            seen[block[valid]] += 1
            blocks_of[owners[b], i] += bool(valid.any())
    assert (seen == 1).all()
    for e in range(E):  # whole blocks of the largest size, then one tail block of the smallest that holds the rest
        whole, rest = divmod(int(counts[e]), sizes[-1])
        want = torch.zeros(len(sizes), dtype=torch.int64)
        want[-1] = whole
        if rest:
            want[next(i for i, s in enumerate(sizes) if s >= rest)] += 1
        assert torch.equal(blocks_of[e], want), (e, counts[e], blocks_of[e])


SORT_KERNEL_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops import expert_sort as m
    from k3serve.ops.expert_sort import sort_by_expert_kernel
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    cases = [(300, 4, 9, (16, 32, 128)), (700, 8, 64, (16, 32, 64, 128)), (40, 2, 7, (16,)), (1, 2, 5, (32, 64)),
             (2000, 3, 33, (64, 128))]
    for T, k, E, sizes in cases:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        if T == 2000:  # skewed: one expert in most tokens (dozens of its blocks, the others' few)
            ids[:1500, 0] = 3
        ref = m._sort_torch(ids, E, sizes)
        for _ in range(2):  # twice: the first call must leave its counters at zero
            got = sort_by_expert_kernel(ids, E, sizes, tuple(m._sort_totals(ids.numel(), E, sizes)))
            assert not m.layout_mismatches(ids, ref, got), (T, sizes, m.layout_mismatches(ids, ref, got))
    # sort_by_expert past the one-program kernel's reach takes it where SORT_KERNEL
    ids = torch.stack([torch.randperm(40, generator=gen)[:8] for _ in range(600)])
    m.SORT_KERNEL = True
    rows, owners = m.sort_by_expert(ids, 40, 64)
    ref_rows, ref_owners = m.sort_by_expert_torch(ids, 40, 64)
    assert torch.equal(owners, ref_owners) and torch.equal(rows.view(-1, 64).sort(1).values,
                                                           ref_rows.view(-1, 64).sort(1).values)
    print(0.0)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_two_launch_expert_sort_matches_the_torch_layouts(seed):
    """expert_sort's two launches (prefill's sort, ``SORT_KERNEL``) give the torch form's blocks,
    owners and padding at one to four row-block sizes, skewed routing included, and leave their
    counters at zero for the next call."""
    assert worst_error(SORT_KERNEL_SCRIPT, str(seed)) == 0.0


def test_layout_check_ignores_row_order_in_an_expert_and_nothing_else():
    """``layout_mismatches`` (what the GPU check and the test above judge the two-launch sort by)
    accepts the torch layout with an expert's rows moved between its blocks and sizes, and names
    each kind of wrong layout."""
    import torch
    from k3serve.ops.expert_sort import _sort_torch, layout_mismatches
    gen = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(9, generator=gen)[:3] for _ in range(300)])
    ids[:200, 0] = 4  # expert 4: 200+ rows, whole blocks of 64 and a tail block of 16 or 32
    ref = _sort_torch(ids, 9, (16, 32, 64))
    n = ids.numel()

    def mutated(edit):
        got = [(bm, rows.clone(), owners.clone()) for bm, rows, owners in ref]
        edit(got)
        return layout_mismatches(ids, ref, got)

    def blocks_of(got, size_index, expert):
        bm, rows, owners = got[size_index]
        return bm, rows, (owners == expert).nonzero().flatten()

    def move_in_expert(got):  # expert 4's first row in its first big block <-> its first tail row
        bm, rows, blocks = blocks_of(got, 2, 4)
        tail = next(i for i in range(2) if (got[i][2] == 4).any() and (got[i][1] < n).any())
        tbm, trows, tblocks = blocks_of(got, tail, 4)
        a, b = blocks[0] * bm, tblocks[0] * tbm
        rows[a], trows[b] = trows[b].clone(), rows[a].clone()
        rows[a:a + bm] = rows[a:a + bm].flip(0).roll(int((rows[a:a + bm] < n).sum()))  # reorder the block

    def swap_experts(got):  # a row of expert 4 <-> a row of another expert's block
        bm, rows, owners = got[2]
        other = ((owners != 4) & (rows.view(-1, bm)[:, 0] < n)).nonzero()[0, 0] * bm
        mine = (owners == 4).nonzero()[0, 0] * bm
        rows[other], rows[mine] = rows[mine].clone(), rows[other].clone()

    def duplicate(got):  # a row written twice, another lost
        bm, rows, owners = got[2]
        start = (owners == 4).nonzero()[0, 0] * bm
        rows[start + 1] = rows[start]

    def pad_first(got):  # padding ahead of a block's valid rows
        bm, rows, owners = got[2]
        start = (owners == 4).nonzero()[-1, 0] * bm
        rows[start:start + bm] = rows[start:start + bm].roll(1)
        if rows[start] < n:
            rows[start + bm - 1] = rows[start]
            rows[start] = n

    def other_owner(got):
        got[1][2][0] = (got[1][2][0] + 1) % 9

    assert mutated(move_in_expert) == []
    assert mutated(swap_experts) == ["size 64: a row in another expert's block"]
    assert mutated(duplicate) == ["assignments missing or repeated"]
    assert "size 64: padding before valid rows" in mutated(pad_first)
    assert mutated(other_owner) == ["size 32: block owners or row count differ"]


@pytest.mark.parametrize("seed", [0, 1])
def test_one_kernel_expert_alignment_matches_the_torch_layout(seed):
    """The single-program counting sort gives the torch form's padded segments and block owners."""
    assert worst_error(ALIGN_SCRIPT, str(seed)) == 0.0


ROUTE_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops.moe_ref import route
    from k3serve.ops.expert_sort import sort_by_expert
    from k3serve.ops import moe_triton
    from k3serve.ops.moe_triton import route_triton
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    cases = [(1, 256, 8, True, True, "sigmoid", 2.446), (7, 64, 6, False, True, "sigmoid", 1.0),
             (5, 896, 16, True, True, "sigmoid", 2.5), (4, 60, 4, True, False, "softmax", 1.0),
             (3, 16, 1, False, False, "sigmoid", 1.0)]
    for T, E, K, biased, renorm, func, scaling in cases:
        logits = torch.randn(T, E, generator=gen) * 2
        bias = torch.randn(E, generator=gen) * 0.3 if biased else None
        w_ref, ids_ref = route(logits, bias, K, 1, 1, renorm, scaling, func)
        w, ids = route_triton(logits, bias, K, renorm, scaling, func)
        assert torch.equal(ids, ids_ref), (T, E, K, ids, ids_ref)  # same experts in the same (descending) order
        worst = max(worst, ((w - w_ref).norm() / w_ref.norm()).item())
        # partial sums over chunks of D (router_logits(split=True)), exact in fp32 here: added first
        exact = torch.stack([torch.randperm(E, generator=gen) - E // 2 for _ in range(T)]) / 64.0  # no ties
        w_ref, ids_ref = route(exact, bias, K, 1, 1, renorm, scaling, func)
        for n, unrolled in ((3, 32), (19, 32), (19, 0)):  # a few parts, and as many as kimi-linear's router
            moe_triton.ROUTE_STATIC_PARTS = unrolled  # writes (18), summed unrolled and in a loop
            parts = torch.randint(-64, 64, (n, T, E), generator=gen) / 16.0
            parts[-1] = exact - parts[:-1].sum(0)  # multiples of 1/64: every sum exact in any order
            w, ids = route_triton(parts, bias, K, renorm, scaling, func, num_shared=2)
            assert torch.equal(ids[:, :K], ids_ref) and (ids[:, K:] == torch.tensor([E, E + 1])).all()
            assert (w[:, K:] == 1).all()
            worst = max(worst, ((w[:, :K] - w_ref).norm() / w_ref.norm()).item())
    for E, K in ((256, 8), (896, 16)):  # NaN scores (an overflowed activation): ids stay real experts
        logits = torch.randn(3, E, generator=gen)
        logits[0] = float("nan")
        logits[1, ::3] = float("nan")
        w, ids = route_triton(logits, None, K, True, 1.0)
        assert ids.min() >= 0 and ids.max() < E, ids
        assert not set(ids[1].tolist()) & set(range(0, E, 3)), ids[1]  # a NaN score is never chosen
        assert sorted(ids[0].tolist()) == list(range(K))  # all NaN: distinct experts
        rows, blocks = sort_by_expert(torch.tensor([[0, E + 5, -3, E - 1]]), E, 16)  # bad ids: stay in bounds
        assert blocks.min() >= 0 and blocks.max() < E and sorted(rows[rows < 4].tolist()) == [0, 1, 2, 3]
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_one_kernel_routing_matches_reference(seed):
    assert worst_error(ROUTE_SCRIPT, str(seed)) < 1e-6


GEMM_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import glu_activation
    from k3serve.ops.mxfp4 import dequantize_mxfp4
    from k3serve.ops.expert_sort import sort_by_expert
    from k3serve.ops.moe_triton import grouped_gemm
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    E, N, K, T, top_k = 5, 48, 256, 6, 2
    for swap in (False, True):
        # every E2M1 code, scales from 2^-127 (s = 0, a subnormal factor) to 2^13
        packed = torch.randint(0, 256, (2, E, N, K // 2), dtype=torch.uint8, generator=gen)
        scale = torch.randint(110, 141, (2, E, N, K // 32), dtype=torch.uint8, generator=gen)
        scale[0, 0, 0, 0] = 0
        x = torch.randn(T, K, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(T)])
        rows, blocks = sort_by_expert(ids, E, 16)
        row_scale = torch.rand(T * top_k, generator=gen)
        w = dequantize_mxfp4(packed, scale)  # [2, E, N, K] fp32, exact
        xa = x.float()[torch.arange(T * top_k) // top_k]
        ea = ids.flatten()
        ref_g = torch.einsum("ak,ank->an", xa, w[0, ea])
        ref_u = torch.einsum("ak,ank->an", xa, w[1, ea])
        tiles = dict(BLOCK_N=16, SWAP_AB=swap)
        for upcast in ("dot_scaled", "asm"):  # (asm: the interpreted twin of the PTX, same k order and scaling)
            out = grouped_gemm(x, rows, blocks, T * top_k, top_k, packed[0], scale[0], N, 16, tiles=tiles,
                               row_scale=row_scale, mx_upcast=upcast)
            ref = ref_g * row_scale[:, None]
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
            out = grouped_gemm(x, rows, blocks, T * top_k, top_k, packed[0], scale[0], N, 16, tiles=tiles,
                               up=(packed[1], scale[1]), act=("silu", 1.0, None), mx_upcast=upcast)
            ref = glu_activation(ref_g, ref_u, "silu", 1.0, None)
            worst = max(worst, ((out - ref).norm() / ref.norm()).item())
            assert torch.isfinite(out).all()
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_dot_scaled_matches_exact_dequantisation(seed):
    """The bf16-activation MXFP4 paths (tl.dot_scaled; our PTX upcast in its interpreted twin) against fp32 matmuls of the exactly
    dequantised weights: every code, extreme scales, both MMA orientations, with and without the
    fused GLU."""
    assert worst_error(GEMM_SCRIPT, str(seed)) < 1e-5


COMBINE_SCRIPT = textwrap.dedent('''
    import itertools, os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.model.layers import RMSNorm
    from k3serve.ops.moe_triton import combine_experts
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    cases = [(5, 2, 48, False, False, None), (3, 4, 100, True, False, torch.float32),
             (4, 8, 64, False, True, torch.float32), (2, 3, 96, True, True, torch.bfloat16),
             (2, 2, 1100, False, True, torch.float32), (2, 2, 1100, True, False, None),
             (3, 16, 3584, True, True, torch.bfloat16)]  # K3's latent: 14 blocks a row
    # the rows in fp32, and in bf16 as prefill's down GEMM writes them (ROWS_IN_ACTIVATION_DTYPE_FROM)
    for (T, top_k, D, use_norm, use_add, dtype), y_dtype in itertools.product(cases, (torch.float32, torch.bfloat16)):
        y = torch.randn(T * top_k, D, generator=gen).to(y_dtype)
        norm = None
        if use_norm:
            norm = RMSNorm(D, 1e-6, torch.float32)
            norm.weight.data = torch.rand(D, generator=gen) + 0.5
        wide = torch.randn(T, D + 4, generator=gen).to(dtype or torch.float32)
        add = wide[:, 1:1 + D] if use_add else None  # strided rows
        out = combine_experts(y, top_k, norm, add, dtype)
        exact = y.float().view(T, top_k, D).sum(1)
        if norm is not None:
            exact = norm(exact, out_dtype=torch.float32)
        if add is not None:
            exact = exact + add.float()
        assert out.shape == (T, D) and out.dtype == (dtype or torch.float32)
        tol = 1e-5 if out.dtype == torch.float32 else 2.0 ** -7
        worst = max(worst, ((out.float() - exact).norm() / exact.norm()).item() / tol)
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_combine_sums_norms_adds_and_casts_once(seed):
    """The top-k sum of the weighted expert rows (fp32, or bf16 as prefill writes them), K3's latent
    norm, the shared experts' add and the cast in one kernel, against the same steps in torch (fp32)."""
    assert worst_error(COMBINE_SCRIPT, str(seed)) < 1.0


LOGITS_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    import torch.nn.functional as F
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.ops import moe_triton
    from k3serve.ops.moe_triton import router_logits
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    for T, E, D, dtype in [(1, 256, 300, torch.bfloat16), (5, 70, 128, torch.float32), (17, 96, 200, torch.bfloat16)]:
        wide = torch.randn(T, D + 9, generator=gen).to(dtype)
        x = wide[:, 4:4 + D]  # strided rows
        w = torch.randn(E, D, generator=gen) * D ** -0.5
        out = router_logits(x, w)
        ref = F.linear(x.double(), w.double())
        assert out.dtype == torch.float32 and out.shape == (T, E)
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
        ref = F.linear(x.double(), w.to(dtype).double())
        for preload in (False, True):  # (ROUTER_PRELOAD: the weight tile read before the PDL wait)
            moe_triton.ROUTER_PRELOAD = preload
            parts = router_logits(x, w.to(dtype), split=True)  # the weight in the model dtype, as the Router holds it
            assert parts.shape == (-(-D // 128), T, E)
            worst = max(worst, ((parts.double().sum(0) - ref).norm() / ref.norm()).item())
    # prefill sizes (past ROUTER_KERNEL_MAX_TOKENS) through the GEMM kernel (ROUTER_PREFILL_KERNEL):
    # several token and expert blocks, D past one chunk and not a multiple of it
    moe_triton.ROUTER_PREFILL_KERNEL = True
    for T, E, D, dtype in [(70, 9, 100, torch.float32), (130, 40, 300, torch.bfloat16)]:
        x = torch.randn(T, D + 9, generator=gen).to(dtype)[:, 4:4 + D]
        w = (torch.randn(E, D, generator=gen) * D ** -0.5).to(dtype)
        out = router_logits(x, w)
        ref = F.linear(x.double(), w.double())
        assert out.dtype == torch.float32 and out.shape == (T, E)
        worst = max(worst, ((out.double() - ref).norm() / ref.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_router_logits_kernel_is_fp32_exact(seed):
    """Decode-size router logits in one launch from x and the weight in the model dtype: fp32
    products and sums (no TF32), against float64; whole or as partial sums over chunks of D; and
    prefill-size logits from the router GEMM kernel (``ROUTER_PREFILL_KERNEL``)."""
    assert worst_error(LOGITS_SCRIPT, str(seed)) < 1e-6


ADD_NORM_ROUTER_SCRIPT = textwrap.dedent('''
    import dataclasses, os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.config import ModelConfig
    from k3serve.model import moe as moe_module
    from k3serve.model.layers import RMSNorm
    from k3serve.model.moe import MoE
    from k3serve.ops import moe_triton
    from k3serve.ops.norm_triton import add_rms_norm_triton
    from k3serve.presets import preset_config
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # the kernel: norm_triton's add + RMSNorm exactly (strided rows, D past one 128-wide chunk and
    # not a multiple of it), the logits of its rounded output in fp32
    for T, E, D, dtype in [(1, 70, 300, torch.bfloat16), (3, 256, 200, torch.float32), (4, 40, 128, torch.bfloat16)]:
        h = torch.randn(T, D + 7, generator=gen).to(dtype)[:, 3:3 + D]
        delta = torch.randn(T, D, generator=gen).to(dtype)
        nw = (1 + torch.randn(D, generator=gen) / 4).to(dtype)
        w = (torch.randn(E, D, generator=gen) * D ** -0.5).to(dtype)
        assert moe_triton.add_norm_router_applies(h, delta, w)
        h2, y2, parts = moe_triton.add_norm_router_logits(h, delta, nw, 1e-6, w)
        h1, y1 = add_rms_norm_triton(h, delta, nw, 1e-6)
        assert torch.equal(h1, h2) and torch.equal(y1, y2) and parts.shape == (-(-D // 128), T, E)
        ref = y1.double() @ w.double().T
        worst = max(worst, ((parts.double().sum(0) - ref).norm() / ref.norm()).item())
    # the model's MoE layer: add_norm_route, then forward on its logits = add + norm, then forward
    cfg = dataclasses.replace(ModelConfig.from_dict(preset_config("kimi-linear-48b")), hidden_size=160,
                              moe_intermediate_size=32, num_experts=12, num_experts_per_token=3)
    moe, norm = MoE(cfg, torch.float32), RMSNorm(160, 1e-6, torch.float32)
    for p in list(moe.parameters()) + list(norm.parameters()):
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5 + (1 if p is norm.weight else 0))
    moe.join_shared_experts()
    moe_module.triton_enabled = lambda op, device: op in ("MOE", "NORM")  # Triton on CPU tensors (interpreted)
    moe_module.norm_kernel_on = lambda x: True
    h, delta = (torch.randn(2, 160, generator=gen) for _ in range(2))
    with torch.inference_mode():
        h2, y2, parts = moe.add_norm_route(h, delta, norm)
        h1, y1 = add_rms_norm_triton(h, delta, norm.weight, norm.eps)
        assert torch.equal(h1, h2) and torch.equal(y1, y2)
        fused, plain = moe(y2, logit_parts=parts), moe(y1)
        worst = max(worst, ((fused - plain).norm() / plain.norm()).item())
        assert moe.add_norm_route(torch.randn(5, 160), torch.randn(5, 160), norm) is None  # too many tokens
        moe_triton.ADD_NORM_ROUTER = False
        assert moe.add_norm_route(h, delta, norm) is None
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_add_norm_and_router_logits_in_one_launch(seed):
    """The residual add + RMSNorm before a MoE layer and its router logits in one kernel: the
    add + norm bit-equal to norm_triton's, the logits of its rounded output fp32-exact against
    float64; the MoE layer on those logits as on its own."""
    assert worst_error(ADD_NORM_ROUTER_SCRIPT, str(seed)) < 1e-6


MODEL_ADD_NORM_ROUTER_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.config import ModelConfig
    from k3serve.model import moe as moe_module
    from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
    from k3serve.model.k3 import K3ForCausalLM
    from k3serve.model.weights import load_dummy
    from k3serve.ops import moe_triton
    from k3serve.presets import preset_config
    raw = preset_config("kimi-linear-48b")  # its layer path (pre-norm residual adds, one expert group) at small widths
    raw.update(vocab_size=512, hidden_size=160, num_hidden_layers=3, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=2, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               num_experts=12, num_experts_per_token=3, moe_intermediate_size=32, bos_token_id=500,
               eos_token_id=501, pad_token_id=511)
    raw["linear_attn_config"].update(kda_layers=[1, 2], full_attn_layers=[3], num_heads=2, head_dim=32)
    net = K3ForCausalLM(ModelConfig.from_dict(raw), torch.float32, "cpu")
    load_dummy(net, 0)
    net.fuse_projections()
    net.eval()
    moe_module.triton_enabled = lambda op, device: op in ("MOE", "NORM")  # the MoE layers' Triton path, interpreted
    moe_module.norm_kernel_on = lambda x: True
    calls = []
    fused = moe_triton.add_norm_router_logits
    moe_triton.add_norm_router_logits = lambda *a: calls.append(a[0].shape) or fused(*a)
    logits = []
    for on in (True, False):
        moe_triton.ADD_NORM_ROUTER = on
        caches = CacheHandles.allocate(net.config, 2, 2, 64, device="cpu", dtype=torch.float32)
        batch = ForwardBatch.build([SeqChunk([5, 9], 0, 0, [0]), SeqChunk([7], 0, 1, [1])], 64, "cpu")
        with torch.inference_mode():
            logits.append(net.compute_logits(net(batch, caches)))
    moe_layers = sum(hasattr(layer, "block_sparse_moe") for layer in net.model.layers)
    assert moe_layers >= 2 and calls == [(3, 160)] * moe_layers, (moe_layers, calls)
    print(((logits[0] - logits[1]).norm() / logits[1].norm()).item())
''')


def test_model_takes_the_add_norm_router_kernel_before_moe_layers():
    """kimi-linear's layer loop at a few tokens: each MoE layer's add + norm and router logits come
    from the one-launch kernel, and the logits match the two-launch path's."""
    assert worst_error(MODEL_ADD_NORM_ROUTER_SCRIPT) < 1e-5


JOIN_SCRIPT = textwrap.dedent('''
    import dataclasses, os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from k3serve.config import ModelConfig
    from k3serve.model import moe as moe_module
    from k3serve.model.moe import MoE
    from k3serve.ops import moe_triton as moe_ops
    from k3serve.presets import preset_config
    cfg = dataclasses.replace(ModelConfig.from_dict(preset_config("kimi-linear-48b")), hidden_size=64,
                              moe_intermediate_size=32, num_experts=12, num_experts_per_token=3)
    groups = int(sys.argv[1])
    if groups > 1:  # grouped top-k: the torch routing, the shared column appended after it
        cfg = dataclasses.replace(cfg, num_expert_group=groups, topk_group=2)
    gen = torch.Generator().manual_seed(groups)
    moe = MoE(cfg, torch.float32)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    x = torch.randn(5, 64, generator=gen)
    with torch.inference_mode():
        ref = moe(x)  # reference path: shared MLP + routed experts apart
        shared_before = [m.weight.clone() for m in (moe.shared_experts.gate_proj, moe.shared_experts.down_proj)]
        assert moe.experts.join_shared(moe.shared_experts) and moe.experts.num_shared == 1
        moe.join_shared_experts()  # idempotent
        assert moe.experts.num_shared == 1 and moe.experts.w1_joined.shape[0] == 13
        # the shared and routed weights are views of the joined stacks: nothing held twice, values kept
        gp, dp = moe.shared_experts.gate_proj.weight, moe.shared_experts.down_proj.weight
        assert gp.data_ptr() == moe.experts.w1_joined[12].data_ptr() and torch.equal(gp, shared_before[0])
        assert dp.data_ptr() == moe.experts.w2_joined[12].data_ptr() and torch.equal(dp, shared_before[1])
        assert moe.experts.w1.data_ptr() == moe.experts.w1_joined.data_ptr()
        unjoined_torch = moe(x)  # the torch path ignores the join
        moe_module.triton_enabled = lambda op, device: op == "MOE"  # Triton on CPU tensors (interpreted)
        w, ids = moe.gate(x, num_shared=1)
        assert (ids[:, -1] == 12).all() and (w[:, -1] == 1).all() and (ids[:, :-1] < 12).all()
        joined = moe(x)
        one = []  # one token: the shared expert's gate / up programs run ahead of the routing, or not
        for ahead in (True, False):
            moe_ops.SHARED_BEFORE_WAIT = ahead
            one.append(moe(x[:1]))
    worst = max(((joined - ref).norm() / ref.norm()).item(), ((unjoined_torch - ref).norm() / ref.norm()).item(),
                *(((o - ref[:1]).norm() / ref[:1].norm()).item() for o in one))
    print(worst)
''')


STATIC_TAIL_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.nn.functional as F
    from k3serve.ops.expert_sort import one_row_blocks
    from k3serve.ops.moe_triton import grouped_gemm
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    E, S, N, K, top = 6, 2, 48, 64, 3  # routed experts, then S static ones; top routed + S static assignments
    w, w_up = (torch.randn(E + S, N, K, generator=gen) * K ** -0.5 for _ in range(2))
    s = s_up = None
    if sys.argv[2] == "mxfp4":  # (MXFP4 stacks: kimi-linear's quantised at load with the shared expert joined)
        from k3serve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4
        (w, s), (w_up, s_up) = quantize_mxfp4(w), quantize_mxfp4(w_up)
    x = torch.randn(1, K, generator=gen)
    ids = torch.tensor([4, 0, 2, E, E + 1])
    rows = one_row_blocks(top + S, 16, x.device)
    stale = torch.tensor([4, 0, 2, 1, 3])  # the static blocks must not read their experts from here
    out = grouped_gemm(x, rows, stale, top + S, top + S, w, s, N, 16, up=(w_up, s_up), static_tail=S,
                       static_expert0=E)
    if s is not None:
        w, w_up = dequantize_mxfp4(w, s, torch.float32), dequantize_mxfp4(w_up, s_up, torch.float32)
    ref = F.silu(torch.einsum("k,ank->an", x[0], w[ids])) * torch.einsum("k,ank->an", x[0], w_up[ids])
    print(((out - ref).norm() / ref.norm()).item())
''')


def test_static_tail_blocks_take_their_experts_from_the_arguments():
    """A one-token layout's last blocks (joined shared experts) with constant experts: computed from
    static_expert0 on, whatever the block-expert array holds for them (it is the router's output,
    not yet written when they run); bf16 and MXFP4 stacks."""
    assert worst_error(STATIC_TAIL_SCRIPT, "0", "bf16") < 1e-6
    assert worst_error(STATIC_TAIL_SCRIPT, "0", "mxfp4") < 1e-5


@pytest.mark.parametrize("groups", [1, 4])
def test_shared_expert_joined_to_routed_stacks_matches_reference(groups):
    """Kimi-Linear's shared MLP as expert E of the routed stacks (decode batches): the same output
    as the shared MLP added to the routed sum, weights held once."""
    assert worst_error(JOIN_SCRIPT, str(groups)) < 1e-5


def test_mxfp4_upcast_choice_and_tuned_tiles(monkeypatch):
    """Which MXFP4 path a call takes (our upcast only where it measured faster, and where the GPU
    has mul.bf16x2), and that each path is tuned only over the tiles it was checked with."""
    import torch

    from k3serve.ops import moe_triton as m

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    monkeypatch.setattr(m, "interpreted", lambda: False)
    assert m.weights_mode(False, bf16, cpu, 16, 1024) == "bf16"
    assert m.weights_mode(True, torch.float32, cpu, 16, 1024) == "mx_decode"  # the exact path
    assert m.weights_mode(True, bf16, cpu, 16, 1024) == "mx_dot_scaled"  # no sm_90 here
    monkeypatch.setattr(m, "has_bf16x2_mul", lambda device: True)
    assert m.weights_mode(True, bf16, cpu, 16, m.ASM_MIN_ASSIGNMENTS) == "mx_asm"
    assert m.weights_mode(True, bf16, cpu, 16, m.ASM_MIN_ASSIGNMENTS - 1) == "mx_dot_scaled"  # 1-token steps
    assert m.weights_mode(True, bf16, cpu, 128, 65536) == "mx_dot_scaled"  # prefill row blocks
    assert m.weights_mode(True, bf16, cpu, 128, 16, mx_upcast="asm") == "mx_asm"  # an explicit choice wins
    with pytest.raises(ValueError, match="mx_upcast"):
        m.weights_mode(True, bf16, cpu, 16, 16, mx_upcast="swar")
    tiles = lambda cs: {(c.kwargs["BLOCK_N"], c.kwargs["SWAP_AB"], c.num_warps, c.num_stages) for c in cs}  # noqa: E731
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, {}, WEIGHTS="mx_asm")) == m._ASM_TILES
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, {}, WEIGHTS="mx_dot_scaled")) == m._TILES
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, {"WEIGHTS": "bf16"})) == m._TILES
    # bf16 prefill row counts add the wide / deep tiles; MXFP4 and decode classes never see them
    prefill = {"WEIGHTS": "bf16", "rows_class": m.PREFILL_TILES_MIN_ROWS}
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, prefill)) == m._TILES | m._PREFILL_TILES
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, dict(prefill, rows_class=1024))) == m._TILES
    assert tiles(m._tiles_for_weights(m.GROUPED_GEMM_CONFIGS, dict(prefill, WEIGHTS="mx_dot_scaled"))) == m._TILES


def test_one_token_layout_is_a_block_per_assignment():
    """A batch-1 step skips the sort: block i holds assignment i (the token's experts are
    distinct, so that is the sorted layout up to block order), the rest of each block padding."""
    import torch

    from k3serve.ops.expert_sort import one_row_blocks

    rows = one_row_blocks(3, 4, torch.device("cpu"))
    assert rows.tolist() == [0, 3, 3, 3, 1, 3, 3, 3, 2, 3, 3, 3]
    assert one_row_blocks(3, 4, torch.device("cpu")) is rows  # built once: graphs keep its address


MMA_SCRIPT = textwrap.dedent('''
    import os, sys, torch
    os.environ["TRITON_INTERPRET"] = "1"
    import torch.nn.functional as F
    from k3serve.model.loader import load_model
    from k3serve.ops import moe_triton as m
    from k3serve.ops.expert_sort import sort_by_expert
    from k3serve.ops.moe_ref import experts_ref
    from k3serve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4, to_mma_layout
    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    worst = 0.0
    # the grouped GEMM on MMA-layout weights: plain and with the GLU epilogue, row blocks of 16
    # and 64, tiles of 2 and 4 row blocks, K tiles of 1, 2 and 4 scale groups, scales 2^-20..2^4
    for T, top, E, N, K, bm, bn, bk in ((1, 4, 8, 64, 128, 16, 32, 128), (5, 2, 4, 32, 64, 16, 64, 64),
                                         (23, 2, 4, 48, 96, 64, 32, 32)):
        def stack():
            w = torch.randn(E, N, K, generator=gen) * torch.exp2(torch.randint(-20, 5, (E, N, 1), generator=gen).float())
            return quantize_mxfp4(w)
        (gp, gs), (up, us) = stack(), stack()
        ids = torch.rand(T, E, generator=gen).topk(top, dim=-1).indices
        x = torch.randn(T, K, generator=gen).bfloat16()
        rows, blocks = sort_by_expert(ids, E, bm)
        xa, a = x.float()[torch.arange(T * top) // top], ids.flatten()
        gate = torch.einsum("ak,ank->an", xa, dequantize_mxfp4(gp, gs)[a])
        glu = F.silu(gate) * torch.einsum("ak,ank->an", xa, dequantize_mxfp4(up, us)[a])
        for exact, kw in ((gate, {}), (glu, dict(up=(to_mma_layout(up), us)))):
            out = m.grouped_gemm(x, rows, blocks, T * top, top, to_mma_layout(gp), gs, N, bm, block_k=bk,
                                 mx_upcast="mma", tiles=dict(BLOCK_N=bn, SWAP_AB=True), **kw)
            worst = max(worst, ((out - exact).norm() / exact.norm()).item())
    # a model's experts rewritten in place: the same outputs, the reference reading either layout
    model = load_model(preset="tiny", dtype="bfloat16", device="cpu", seed=3, mxfp4=True)
    moe = model.model.layers[1].block_sparse_moe
    ex = moe.experts
    x = torch.randn(7, ex.w1_packed.shape[-1] * 2, generator=gen).bfloat16()
    w, ids = moe.gate(torch.randn(7, model.config.hidden_size, generator=gen).bfloat16())
    fp32 = lambda e: tuple(t.float() for t in ex.expert(e))
    ref = experts_ref(x.float(), w, ids, fp32, *ex.act)
    before = m.experts_triton(x, w, ids, ex)
    dense = [t.clone() for t in ex.expert(3)]
    assert ex.use_mma_layout() and ex.mma_layout and not ex.use_mma_layout()
    assert all(torch.equal(a, b) for a, b in zip(dense, ex.expert(3)))
    assert torch.equal(experts_ref(x.float(), w, ids, fp32, *ex.act), ref)
    after = m.experts_triton(x, w, ids, ex)  # (scaled per group: another summation order, so not bit-equal)
    worst = max(worst, ((after.float() - before.float()).norm() / before.float().norm()).item())
    # row blocks of mixed sizes (sort_by_expert_sizes, ~24 rows an expert: whole blocks of 32,
    # tails of 16 and 32): several launches into one output, the same result as blocks of 16
    x = torch.randn(96, x.shape[1], generator=gen).bfloat16()
    w, ids = moe.gate(torch.randn(96, model.config.hidden_size, generator=gen).bfloat16())
    one = m.experts_triton(x, w, ids, ex, block_m=16).float()
    mixed = m.experts_triton(x, w, ids, ex, block_sizes=(16, 32)).float()
    worst = max(worst, ((mixed - one).norm() / one.norm()).item())
    # ... and with the programs ordered column tile fastest
    cols = m.experts_triton(x, w, ids, ex, block_sizes=(16, 32), tiles=dict(BLOCK_N=32, SWAP_AB=True, cols_first=True))
    worst = max(worst, ((cols.float() - one).norm() / one.norm()).item())
    print(worst)
''')


@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_mma_layout_gemm_matches_exact_dequantisation(seed):
    """The MMA-layout upcast ("mx_mma", its interpreted twin of the PTX) against fp32 matmuls of
    the exactly dequantised weights; and ``RoutedExperts.use_mma_layout`` changes no result."""
    assert worst_error(MMA_SCRIPT, str(seed)) < 1e-5


@pytest.mark.parametrize("din, inter, top_scale, folds", [(128, 256, 128, True), (128, 256, 129, False),
                                                          (128, 64, 100, False)])
def test_folded_scales_checked_once_at_the_mma_rewrite(din, inter, top_scale, folds):
    """moe_gluon folds each block scale into the upcast (2^(E8M0 - 1) as a bf16) and streams K in
    steps of 128 codes: ``use_mma_layout`` records whether every stack allows that (all E8M0 bytes
    <= 128, every K a multiple of 128); only then may decode row blocks take the Gluon kernel."""
    from types import SimpleNamespace

    import torch

    from k3serve.model.moe import RoutedExperts

    cfg = SimpleNamespace(num_experts=4, moe_intermediate_size=inter, expert_format="mxfp4", hidden_act="silu",
                          situ_beta=1.0, situ_linear_beta=None, experts_quantized_at_load=False)
    ex = RoutedExperts(cfg, din, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for n in ("w1", "w2", "w3"):
        getattr(ex, f"{n}_packed").data.random_(0, 256, generator=gen)
        getattr(ex, f"{n}_scale").data.random_(100, 120, generator=gen)
    ex.w2_scale.data[2, 5, 1] = top_scale  # one byte of one stack decides
    assert not ex.folded_scales and ex.use_mma_layout()
    assert ex.folded_scales is folds


def test_row_blocks_and_the_mma_layout_kernel_follow_the_measured_choices(monkeypatch):
    """Decode on MMA-layout experts whose scales fold: the Gluon kernel, row blocks of 8 while
    experts see under two rows on average, else 16; prefill: 64 rows through the Gluon kernel too
    (the timed bests); the checkpoint layout goes to 128; without the fold, "mx_mma"."""
    from k3serve.ops import moe_triton as m

    E = 896
    assert m.row_block(16, E, True, True) == 8 and m.mma_upcast(8, True) == "gluon"
    assert m.row_block(64 * 16, E, True, True) == 8  # K3 at 64 tokens: 1.1 rows an expert
    assert m.row_block(256 * 16, E, True, True) == 16 and m.mma_upcast(16, True) == "gluon"
    assert m.row_block(16, E, True, False) == 16 and m.mma_upcast(16, False) == "mma"  # no fold / unaligned
    assert m.row_block(8192 * 16, E, True, True) == 64 and m.mma_upcast(64, True) == "gluon"
    assert m.row_block(8192 * 16, E, True, False) == 64 and m.mma_upcast(64, False) == "mma"
    assert m.row_block(8192 * 16, E, False, False) == 128  # checkpoint layout
    assert m.row_block(50 * 56, 56, True, True) == m.row_block(50 * 56, 56, False, False) == 64  # dozens an expert
    monkeypatch.setattr(m, "GLUON_PREFILL", False)
    assert m.mma_upcast(64, True) == "mma"
    monkeypatch.setattr(m, "GLUON_DECODE", False)
    assert m.row_block(16, E, True, True) == 16 and m.mma_upcast(16, True) == "mma"


def test_pinned_tile_sets_the_k_tile(monkeypatch):
    """A tile pinned per (N, K, rows class) with a fifth entry sets BLOCK_K: one that does not
    divide K is refused before launch, naming it."""
    import torch

    from k3serve.ops import moe_triton

    x = torch.randn(1, 64)
    w = torch.randn(4, 32, 64)
    rows = torch.arange(16, dtype=torch.int32)
    monkeypatch.setattr(moe_triton, "PINNED", {(32, 64, 1): (32, False, 4, 3, 48)})
    with pytest.raises(ValueError, match="BLOCK_K=48"):
        moe_triton.grouped_gemm(x, rows, torch.zeros(1, dtype=torch.int32), 1, 1, w, None, 32)


def test_route_kernel_warps_follow_the_expert_count(monkeypatch):
    """One warp up to 256 experts (kimi-linear: no shared-memory round trip a top-k round), four at
    K3's 896 (8 logits a lane instead of 32: 41 -> 8 us a call on the H200), at most 8; ROUTE_WARPS pins a count."""
    from k3serve.ops import moe_triton

    assert [moe_triton.route_warps(e) for e in (8, 64, 256, 300, 896, 4096)] == [1, 1, 1, 2, 4, 8]
    monkeypatch.setattr(moe_triton, "ROUTE_WARPS", 2)
    assert moe_triton.route_warps(896) == 2


def test_gluon_split_k_only_where_programs_are_too_few(monkeypatch):
    """K is split only while a decode GEMM's programs cannot fill the GPU: kimi-linear's experts
    quantised at load at one token (9 x 16 and 9 x 36 programs), never K3's (16 x 48) or a batch
    of 4; always into an equal number of whole K steps."""
    import torch

    from k3serve.ops import moe_triton
    from k3serve.ops.moe_triton import grouped_gemm, gluon_split_k

    cpu = torch.device("cpu")  # (sm_count: an H200's 132 off the GPU)
    assert gluon_split_k(9, 1024, 2304, cpu) == 6 and gluon_split_k(9, 2304, 1024, cpu) == 2
    assert gluon_split_k(18, 1024, 2304, cpu) == 3 and gluon_split_k(27, 1024, 2304, cpu) == 2
    assert gluon_split_k(36, 1024, 2304, cpu) == 1 and gluon_split_k(16, 3072, 3584, cpu) == 1
    assert gluon_split_k(1, 1024, 384, cpu) == 3  # K steps 3: whole steps, not the room's 16
    monkeypatch.setattr(moe_triton, "GLUON_SPLIT_K_PER_SM", 0)
    assert gluon_split_k(9, 1024, 2304, cpu) == 1
    x = torch.zeros(1, 64)
    with pytest.raises(ValueError, match="split_k is the Gluon kernel's"):
        grouped_gemm(x, torch.zeros(16, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1, 1,
                     torch.zeros(2, 32, 64), None, 32, split_k=2)

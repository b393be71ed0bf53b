"""Split-KV MLA decode in Triton: absorbed form over the paged 576-wide latent cache.

One query token per sequence, all heads against the single shared latent "KV head": each program
loads a tile of latent rows once and scores it for a block of heads (the latent is read once per
head block, not per head), keeps an online softmax, and writes a partial output plus its
log-sum-exp; the partials of a sequence's splits are merged by their LSE. Splitting the sequence
keeps the GPU full at small batch and long context (FlashMLA / FlashDecoding's scheme). A key tile
that fits in one cache page is addressed from one block-table entry with 32-bit row offsets
(per-row gathers with 64-bit addresses took 28 % more instructions and left a 16-head decode at
60 % of the copy ceiling; page-local tiles reach 83-95 %, RESULTS.md eleventh session).

Reference: ``mla_ref.mla_absorbed_ref``. Checked on CPU with ``TRITON_INTERPRET=1``
(tests/test_mla_decode_triton.py); speed is measured on the GPU ([gpu-kernels]).
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from . import pdl
from .autotune import autotuned, sm_count
from .pdl import pdl_start


@triton.jit
def split_range(SL, b, sp, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys [start, end) of split ``sp`` of sequence ``b``: equal shares in whole key tiles (also
    called from mla_decode_gluon, so both kernels split alike and share the merge)."""
    seq_len = tl.load(SL + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per_split
    return start, tl.minimum(start + per_split, seq_len)


@triton.jit
def _mla_decode_split_kernel(
    QC, QP, KV, BT, SL, O, LSE,
    stride_qb, stride_qh, stride_pb, stride_ph, stride_kvp, stride_kvt, stride_btb, stride_btp, stride_ob, stride_oh,
    stride_os, stride_lb, stride_lh, scale, H, NUM_SPLITS, CTX_BUCKET,
    PAGE: tl.constexpr, D_C: tl.constexpr, D_PE: tl.constexpr,
    D_C_P: tl.constexpr, D_PE_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    # Widths padded to powers of two >= 16 (tl.arange / tl.dot); padding lanes load zeros.
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    start, end = split_range(SL, b, sp, NUM_SPLITS, BLOCK_N)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    dc = tl.arange(0, D_C_P)
    dp = tl.arange(0, D_PE_P)
    cmask, pmask = dc < D_C, dp < D_PE
    q_c = tl.load(QC + b * stride_qb + heads[:, None] * stride_qh + dc[None, :], mask=hmask[:, None] & cmask[None, :],
                  other=0.0)
    q_pe = tl.load(QP + b * stride_pb + heads[:, None] * stride_ph + dp[None, :], mask=hmask[:, None] & pmask[None, :],
                   other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_C_P], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs = n0 + tl.arange(0, BLOCK_N)
        nmask = offs < end
        if PAGE % BLOCK_N == 0:  # the tile lies in one page: one table entry, 32-bit row offsets
            page = tl.load(BT + b * stride_btb + (n0 // PAGE) * stride_btp).to(tl.int64)
            kv = KV + page * stride_kvp + (n0 % PAGE) * stride_kvt
            row = tl.arange(0, BLOCK_N) * stride_kvt
        else:
            page = tl.load(BT + b * stride_btb + (offs // PAGE) * stride_btp, mask=nmask, other=0)
            kv = KV
            row = page.to(tl.int64) * stride_kvp + (offs % PAGE) * stride_kvt
        c = tl.load(kv + row[:, None] + dc[None, :], mask=nmask[:, None] & cmask[None, :], other=0.0)
        pe = tl.load(kv + row[:, None] + D_C + dp[None, :], mask=nmask[:, None] & pmask[None, :], other=0.0)
        s = tl.dot(q_c, tl.trans(c)).to(tl.float32) + tl.dot(q_pe, tl.trans(pe)).to(tl.float32)
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c).to(tl.float32)
        m_i = m_new

    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    # (an empty split writes its -inf alone: the merge never reads its rows)
    rows = heads < tl.where(start < end, H, 0)
    tl.store(O + b * stride_ob + heads[:, None] * stride_oh + sp * stride_os + dc[None, :], out,
             mask=rows[:, None] & cmask[None, :])
    tl.store(LSE + b * stride_lb + heads * stride_lh + sp, lse, mask=hmask)


def _heads_that_fit(configs, named_args, **kwargs):
    """No head block wider than the heads (rounded up to a power of two, at least 16)."""
    cap = max(16, triton.next_power_of_2(named_args["H"]))
    return [c for c in configs if c.kwargs["BLOCK_H"] <= cap] or configs[:1]


# Heads per program (the latent tile is loaded once per head block), key tile and warps, picked on
# the GPU at first use of each shape: the winners of bench/kernels_mla.py's sweeps on the H200 at
# 32K context (RESULTS.md eleventh session): 16 heads 16 / 64 / 4 warps (83-95 % of copy), 32 heads
# 32 / 64 / 4 (61-71 %), 96 heads 64 / 64 / 8 (compute-bound); 16 / 32 for short tables and batch 1.
# Keyed also on the table width rounded up to a power of two (CTX_BUCKET, not read by the kernel):
# a config tuned on short tables was 1.7x slower at 32K.
_mla_decode_tuned = autotuned(
    _mla_decode_split_kernel,
    [triton.Config({"BLOCK_H": bh, "BLOCK_N": bn}, num_warps=w, num_stages=2)
     for bh, bn, w in ((16, 32, 4), (16, 64, 4), (32, 32, 4), (32, 64, 4), (64, 64, 8))],
    triton.Config({"BLOCK_H": 16, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    key=["H", "NUM_SPLITS", "CTX_BUCKET", "D_C", "D_PE", "PAGE"], prune=_heads_that_fit)


# The split step through mla_decode_gluon (keys-major wgmma, the head block as its N). H200, 32K
# context (RESULTS.md fourteenth session), % of copy on latent bytes at batch 16 / 64: 16 heads
# 84 / 97 %, 32 heads 80 / 94 % (this kernel at 32 heads: 61-71 %), 96 heads 0.44 ms against 0.78 (the
# forty-third session's bench.kernels run: 0.57 against 0.60 at batch 16, 1.76 against 2.21 at batch 64;
# heads-major from 64 heads since the forty-seventh: 0.37 / 1.40 ms).
# False: the Triton split kernel.
GLUON_SPLIT = True


# The most splits of one sequence (and head block). At batch 1 each split writes a [heads, 512] fp32
# partial that the merge reads back (64 splits at 32 heads: 4.2 MB, as much as 4K tokens of latent),
# yet 16, 32 and 64 gave the same kimi-linear batch-1 step at 4K context (RESULTS.md twenty-third
# session): the split kernel's ~9.5 us there is latency (a tile's copy, three wgmmas, the store).
MAX_SPLITS = 64


def default_num_splits(batch: int, heads: int, max_tokens: int, sms: int = 132, head_block: int = 32) -> int:
    """Enough (sequence, split) programs for about two waves over the SMs once heads are blocked
    by ``head_block`` (``split_head_block``), but no split shorter than 64 tokens of the table's
    width; a power of two, so eager steps whose tables grow see a handful of values (each is tuned
    once), not one per width.
    (256-token splits left a batch-1 step at 4K context with 16 programs on 132 SMs: 37 us a
    kimi-linear MLA layer for 4.7 MB of latent, RESULTS.md sixth session.)"""
    n = max(1, min(-(-2 * sms // (batch * -(-heads // head_block))), MAX_SPLITS, max_tokens // 64))
    return 1 << (n.bit_length() - 1)


def num_splits_for(batch: int, heads: int, max_tokens: int, device: torch.device, gluon_step: bool) -> int:
    """``default_num_splits`` on ``device`` for the split step that will run (``gluon_step``:
    ``gluon_split_applies``): what ``mla_decode`` picks when not told."""
    return default_num_splits(batch, heads, max_tokens, sm_count(device), split_head_block(heads, gluon_step))


def split_head_block(heads: int, gluon_step: bool) -> int:
    """Heads a split program takes: 32 (this kernel's largest block, the Gluon keys-major step's),
    64 where the Gluon step runs heads-major."""
    if not gluon_step:
        return 32
    from .mla_decode_gluon import heads_per_program

    return heads_per_program(heads)


def gluon_split_applies(latent_pages: torch.Tensor, kv_lora_rank: int, d_pe: int, gluon: bool | None = None) -> bool:
    """Whether ``mla_decode``'s split step goes through ``mla_decode_gluon``: asked for (None:
    ``GLUON_SPLIT``), on CUDA, at K3's widths (512 + 64), bf16 pages of a multiple of 64 tokens."""
    return bool((GLUON_SPLIT if gluon is None else gluon) and latent_pages.is_cuda and (kv_lora_rank, d_pe) == (512, 64)
                and latent_pages.dtype == torch.bfloat16 and latent_pages.shape[1] % 64 == 0)


def mla_decode(q_abs: torch.Tensor, latent_pages: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
               kv_lora_rank: int, scale: float, num_splits: int | None = None, tiles: dict | None = None,
               q_pe: torch.Tensor | None = None, gluon: bool | None = None) -> torch.Tensor:
    """q_abs [B, H, rkv+dr], or [B, H, rkv] with ``q_pe`` [B, H, dr] apart (both may be strided
    views: the absorbed part straight from a batched GEMM, q_pe a slice of the projected queries);
    latent_pages [num_pages, page, rkv+dr] (any page stride); block_table [B, max_pages] (any strides); seq_lens
    [B] (tokens to attend, >= 1). Returns the latent-space output [B, H, rkv] fp32 (unabsorb
    through W_UV afterwards). ``num_splits`` None: from the batch, the heads and the table's width
    (static for a CUDA graph); ``tiles`` (BLOCK_H, BLOCK_N, num_warps, num_stages) None: autotuned.
    ``gluon`` (None: ``GLUON_SPLIT``): the split step in ``mla_decode_gluon`` (keys-major wgmma,
    heads by 32, or heads-major by 64 from ``mla_decode_gluon.HEADS_MAJOR_MIN`` heads; ``tiles``
    unused) where the widths, pages and dtype allow."""
    if q_pe is None:
        q_abs, q_pe = q_abs[..., :kv_lora_rank], q_abs[..., kv_lora_rank:]
    B, H, _ = q_abs.shape
    d_pe = q_pe.shape[-1]
    width = kv_lora_rank + d_pe
    if latent_pages.stride(2) != 1 or latent_pages.stride(1) != width:
        raise ValueError("latent pages must be [pages, page_size, width] with contiguous rows")
    q_abs, q_pe = (t.to(latent_pages.dtype) if t.stride(2) == 1 else t.to(latent_pages.dtype).contiguous()
                   for t in (q_abs, q_pe))
    gluon_step = gluon_split_applies(latent_pages, kv_lora_rank, d_pe, gluon)
    if num_splits is None:
        num_splits = num_splits_for(B, H, block_table.shape[1] * latent_pages.shape[1], q_abs.device, gluon_step)
    partial = torch.empty(B, H, num_splits, kv_lora_rank, dtype=torch.float32, device=q_abs.device)
    lse = torch.empty(B, H, num_splits, dtype=torch.float32, device=q_abs.device)
    if gluon_step:
        from .mla_decode_gluon import mla_decode_split_gluon

        mla_decode_split_gluon(q_abs, q_pe, latent_pages, block_table, seq_lens, partial, lse, scale)
    else:
        kernel, tiles = (_mla_decode_tuned, {}) if tiles is None else (_mla_decode_split_kernel, tiles)
        kernel[lambda meta: (B, triton.cdiv(H, meta["BLOCK_H"]), num_splits)](
            q_abs, q_pe, latent_pages, block_table, seq_lens, partial, lse,
            q_abs.stride(0), q_abs.stride(1), q_pe.stride(0), q_pe.stride(1), latent_pages.stride(0),
            latent_pages.stride(1), block_table.stride(0), block_table.stride(1), partial.stride(0), partial.stride(1), partial.stride(2),
            lse.stride(0), lse.stride(1), scale, H, num_splits,
            triton.next_power_of_2(block_table.shape[1] * latent_pages.shape[1]), PAGE=latent_pages.shape[1],
            D_C=kv_lora_rank, D_PE=d_pe, D_C_P=max(16, triton.next_power_of_2(kv_lora_rank)),
            D_PE_P=max(16, triton.next_power_of_2(d_pe)), **tiles, **pdl.launch(partial.device),
        )
    if not MERGE_KERNEL:  # (an empty split's rows are never written)
        partial = torch.where(torch.isfinite(lse)[..., None], partial, 0.0)
        return torch.matmul(torch.softmax(lse, dim=-1).unsqueeze(2), partial).squeeze(2)
    return merge_splits(partial, lse)


# The splits merged by ``merge_splits`` (one PDL launch); False: torch's softmax and batched GEMV (A/B timing).
MERGE_KERNEL = True


@triton.jit
def _merge_splits_kernel(PARTIAL, LSE, OUT, S, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob,
                         stride_oh, C, S_P: tl.constexpr, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (sequence, head, column block): sum_s softmax(lse)_s * partial_s over the splits; an
    empty split's (lse -inf) rows are not read: a static step splits the table's full width, so at
    a 1M-token max_model_len a short sequence leaves most of its 64 splits empty."""
    pdl_start(USE_PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, S_P)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + s, mask=s < S, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))  # (every sequence attends to >= 1 token: some split is finite)
    w = w / tl.sum(w, 0)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    part = tl.load(PARTIAL + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + cols[None, :],
                   mask=(lse > float("-inf"))[:, None] & (cols < C)[None, :], other=0.0)
    tl.store(OUT + b * stride_ob + h * stride_oh + cols, tl.sum(part * w[:, None], 0), mask=cols < C)


# Columns a merge program: a batch-1 step's 32 heads x 512 latent columns as 128 programs.
MERGE_BLOCK_C = 128


def merge_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The split outputs partial [B, H, S, C] merged by their log-sum-exp lse [B, H, S] (empty
    splits carry -inf and weigh nothing) -> [B, H, C] fp32: one launch in the decode step's PDL
    chain, where torch took two (softmax, then a batched [1, S] x [S, C] GEMV; RESULTS.md
    twenty-second session)."""
    B, H, S, C = partial.shape
    out = torch.empty(B, H, C, dtype=torch.float32, device=partial.device)
    if partial.stride(3) != 1 or lse.stride(2) != 1:
        raise ValueError("merge_splits needs partial rows and lse contiguous along their last dim")
    if out.numel():
        _merge_splits_kernel[(B, H, triton.cdiv(C, MERGE_BLOCK_C))](
            partial, lse, out, S, partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0),
            lse.stride(1), out.stride(0), out.stride(1), C, S_P=max(2, triton.next_power_of_2(S)),
            BLOCK_C=MERGE_BLOCK_C, **pdl.launch(out.device))
    return out

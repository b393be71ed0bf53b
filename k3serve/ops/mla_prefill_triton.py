"""Flash-style MLA prefill in Triton (expanded form): causal attention of a chunk of new tokens
over the sequence's cached + new keys, with the chunk starting at ``context_len``, without ever
materialising the T x S score matrix (online softmax over key blocks).

Keys are [k_nope (per head) ; k_pe (shared by all heads, NoPE: not rotated)], scale 1/sqrt(192);
values are per head. Reference: ``mla_ref.mla_expanded_ref``. Checked on CPU with
``TRITON_INTERPRET=1`` (tests/test_mla_prefill_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .autotune import autotuned, interpreted


@triton.jit
def _attend_block(q_n, q_p, KN, KP, V, h, n0, qpos, S, m_i, l_i, acc, qk_scale,
                  stride_kt, stride_kh, stride_pt, stride_vt, stride_vh, dn, dr, dv, nmask, pmask, vmask,
                  BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """One key block of the online softmax in the log2 domain (exp2), the scale applied in the
    exponent's FFMA (the running max kept scaled: a multiply a row, not an element). MASKED: the
    block crosses the causal diagonal or the sequence's end; blocks wholly below it skip the masks."""
    cols = n0 + tl.arange(0, BLOCK_N)
    cmask = cols < S
    if not MASKED:
        cmask = cols >= 0  # (all true: the loads keep only the head-width padding masks)
    if TMA:  # KN, KP, V are the sequence's tensor descriptors (rows past its keys read as zeros)
        k_n = KN.load([n0, h * stride_kh])
        k_p = KP.load([n0, 0])
    else:
        k_n = tl.load(KN + cols[:, None] * stride_kt + h * stride_kh + dn[None, :],
                      mask=cmask[:, None] & nmask[None, :], other=0.0)
        k_p = tl.load(KP + cols[:, None] * stride_pt + dr[None, :], mask=cmask[:, None] & pmask[None, :], other=0.0)
    s = tl.dot(q_p, tl.trans(k_p), tl.dot(q_n, tl.trans(k_n)))  # raw scores, one fp32 accumulator
    if MASKED:
        s = tl.where((cols[None, :] <= qpos[:, None]) & cmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if TMA:
        v = V.load([n0, h * stride_vh])
    else:
        v = tl.load(V + cols[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=cmask[:, None] & vmask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v).to(tl.float32)
    return m_new, l_i, acc


@triton.jit
def _mla_prefill_kernel(
    Q, KN, KP, V, O, SEQS, context_len, Tq, S, scale, TQ_BUCKET,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_pt, stride_vt, stride_vh, stride_ot, stride_oh,
    DN: tl.constexpr, DR: tl.constexpr, DV: tl.constexpr,
    DN_P: tl.constexpr, DR_P: tl.constexpr, DV_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    VARLEN: tl.constexpr = False, TMA: tl.constexpr = False, HEADS: tl.constexpr = 1,
):
    # Head widths are padded to powers of two >= 16 (tl.arange and tl.dot need them); the padding
    # lanes load zeros, so they add nothing to the scores and are not stored. Query blocks run last
    # first: under the causal mask they hold the most keys, so the long programs start early and
    # the short ones fill the tail.
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    if VARLEN:  # sequence program_id(2) of many back to back: SEQS[n] = (first query row, first key row, context, new)
        n = tl.program_id(2)
        q0 = tl.load(SEQS + 4 * n).to(tl.int64)
        k0 = tl.load(SEQS + 4 * n + 1).to(tl.int64)
        context_len = tl.load(SEQS + 4 * n + 2)
        Tq = tl.load(SEQS + 4 * n + 3)
        S = context_len + Tq
        Q += q0 * stride_qt
        O += q0 * stride_ot
        KN += k0 * stride_kt
        KP += k0 * stride_pt
        V += k0 * stride_vt
    if TMA:  # (``tma_loads``: power-of-two head widths, 16-byte aligned rows) the key and value loads by TMA
        KN = tl.make_tensor_descriptor(KN, shape=[S, (HEADS - 1) * stride_kh + DN], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, DN])
        KP = tl.make_tensor_descriptor(KP, shape=[S, DR], strides=[stride_pt, 1], block_shape=[BLOCK_N, DR])
        V = tl.make_tensor_descriptor(V, shape=[S, (HEADS - 1) * stride_vh + DV], strides=[stride_vt, 1],
                                      block_shape=[BLOCK_N, DV])
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < Tq
    dn = tl.arange(0, DN_P)
    dr = tl.arange(0, DR_P)
    dv = tl.arange(0, DV_P)
    nmask, pmask, vmask = dn < DN, dr < DR, dv < DV
    q_n = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + dn[None, :],
                  mask=rmask[:, None] & nmask[None, :], other=0.0)
    q_p = tl.load(Q + rows[:, None] * stride_qt + h * stride_qh + DN + dr[None, :],
                  mask=rmask[:, None] & pmask[None, :], other=0.0)
    qpos = context_len + rows  # absolute position of each query token
    qk_scale = scale * 1.4426950408889634  # (log2 e: the softmax in exp2)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_P], tl.float32)
    live = mb * BLOCK_M < Tq  # (a shorter sequence's spare query blocks: no work)
    # keys every row of the block sees (below its first query's position), then the diagonal's
    lo = tl.where(live, (context_len + mb * BLOCK_M) // BLOCK_N * BLOCK_N, 0)
    hi = tl.where(live, tl.minimum(S, context_len + (mb + 1) * BLOCK_M), 0)  # causal: later keys are never visible
    for n0 in range(0, lo, BLOCK_N):
        m_i, l_i, acc = _attend_block(q_n, q_p, KN, KP, V, h, n0, qpos, S, m_i, l_i, acc, qk_scale, stride_kt,
                                      stride_kh, stride_pt, stride_vt, stride_vh, dn, dr, dv, nmask, pmask, vmask,
                                      BLOCK_N, False, TMA)
    for n0 in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q_n, q_p, KN, KP, V, h, n0, qpos, S, m_i, l_i, acc, qk_scale, stride_kt,
                                      stride_kh, stride_pt, stride_vt, stride_vh, dn, dr, dv, nmask, pmask, vmask,
                                      BLOCK_N, True, TMA)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (0 only in a shorter sequence's spare blocks)
    tl.store(O + rows[:, None] * stride_ot + h * stride_oh + dv[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None] & vmask[None, :])


def _padded(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _blocks_that_fit(configs, named_args, **kwargs):
    """No query block taller than the chunk (rounded up to a power of two, at least 32)."""
    cap = max(32, named_args["TQ_BUCKET"])
    return [c for c in configs if c.kwargs["BLOCK_M"] <= cap] or configs[-1:]


# Query / key tiles, warps and stages, picked on the GPU per head shape and chunk-length bucket
# (TQ_BUCKET, not read by the kernel). The first version ran 32 x 32 tiles with 4 warps: 34 ms of
# a kimi-linear-48b 8K-token prefill for its 7 MLA layers, ~20 % of the matmul ceiling (RESULTS.md,
# sixth session); FlashAttention-2's Hopper Triton tiles are 128 x 64 with 8 warps. Key blocks below the
# diagonal without masks, exp2, and the longest query blocks first: 53-55 -> 64-68 % of the matmul ceiling
# at 8K tokens, 32 / 96 heads (torch's SDPA 80-82 %; bench/kernels_mla_prefill.py, RESULTS.md thirty-ninth session).
_mla_prefill_tuned = autotuned(
    _mla_prefill_kernel,
    [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
     for bm, bn, w, st in ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3),
                           (32, 32, 4, 2))],
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    key=["DN", "DR", "DV", "TQ_BUCKET", "TMA"], prune=_blocks_that_fit)


def _expanded(q: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor, kv_lora_rank: int, nope_dim: int):
    """Per-head keys and values from the latents (O(S * Ha), never T x S): (q, k_nope, k_pe, v) in
    the weight's dtype, the shared rope part of the keys contiguous."""
    S = latent.shape[0]
    c, k_pe = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    kv = (c.to(w_kv_b.dtype) @ w_kv_b.t()).view(S, q.shape[1], -1)
    dt = kv.dtype
    return q.to(dt).contiguous(), kv[..., :nope_dim], k_pe.to(dt).contiguous(), kv[..., nope_dim:]


# Keys and values loaded by TMA (tensor descriptors made in the kernel over a sequence's own rows)
# instead of cp.async with per-element addresses. sm_90 SASS of the 128 x 64 tile, 8 warps (Triton 3.6,
# ``python -m bench.sass_mix mla_prefill``): 214 -> 154 registers, a key block 388 -> 363 instructions a
# thread below the diagonal and 550 -> 494 on it, but four CTA barriers a block instead of two (Triton
# fences each TMA issue), which couple the two warpgroups more (RESULTS.md fortieth session, CPU). Off until
# the H200 checks and times it (``gpu_check_kernels.py --mla-prefill``, ``bench.kernels_mla_prefill``).
TMA_LOADS = False


def tma_loads(k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether TMA can serve these views: power-of-two widths of at least 16, unit inner strides,
    16-byte aligned bases and row strides (TMA's rules), and tensor descriptors in this Triton."""
    if not (TMA_LOADS and hasattr(tl, "make_tensor_descriptor") and hasattr(triton, "set_allocator")):
        return False
    for t in (k_nope, k_pe, v):
        size = t.element_size()
        if (t.shape[-1] < 16 or t.shape[-1] & (t.shape[-1] - 1) or t.stride(-1) != 1 or t.data_ptr() % 16
                or any(st * size % 16 for st in t.stride()[:-1])):
            return False
    return True


def _descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch for the descriptors a kernel makes, from torch's allocator (a CUDA graph's pool
    when captured). Triton keeps its allocator in a context variable, i.e. per thread: set at each
    launch, as the engine's step may run on another thread than the one that first launched."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if interpreted() else "cuda")


def tq_bucket(max_tq: int) -> int:
    """The autotuning key's chunk-length class: the longest new-token count, rounded up to a power of
    two. Steps whose buckets differ may run other tiles (so other bits): a static prefill step
    passes its bucket's token count, the flat step its longest prompt."""
    return min(triton.next_power_of_2(max_tq), 8192)


def _launch(q, latent, w_kv_b, kv_lora_rank, nope_dim, scale, tiles, grid_seqs, seqs, context_len, S, max_tq, out):
    q, k_nope, k_pe, v = _expanded(q, latent, w_kv_b, kv_lora_rank, nope_dim)
    Tq, Ha, _ = q.shape
    dv, dr = v.shape[-1], q.shape[-1] - nope_dim
    if out is None:
        out = torch.empty(Tq, Ha, dv, dtype=torch.float32, device=q.device)
    elif out.shape != (Tq, Ha, dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{Tq}, {Ha}, {dv}] with unit last stride, got {tuple(out.shape)} "
                         f"strides {out.stride()}")
    tma = tma_loads(k_nope, k_pe, v)
    if tma:
        triton.set_allocator(_descriptor_scratch)
    kernel, tiles = (_mla_prefill_tuned, {}) if tiles is None else (_mla_prefill_kernel, tiles)
    kernel[lambda meta: (triton.cdiv(max_tq, meta["BLOCK_M"]), Ha, grid_seqs)](
        q, k_nope, k_pe, v, out, seqs if seqs is not None else out, context_len, Tq, S, scale,
        tq_bucket(max_tq),
        q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), k_pe.stride(0), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        DN=nope_dim, DR=dr, DV=dv, DN_P=_padded(nope_dim), DR_P=_padded(dr), DV_P=_padded(dv),
        VARLEN=seqs is not None, TMA=tma, HEADS=Ha if tma else 1, **tiles,  # (HEADS: the descriptors' width)
    )
    return out


def mla_prefill(q: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor, context_len: int, kv_lora_rank: int,
                nope_dim: int, scale: float, tiles: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``mla_ref.mla_expanded_ref``: q [Tq, Ha, dn+dr]; latent [S, rkv+dr] with
    S = context_len + Tq; w_kv_b [Ha*(dn+dv), rkv]. Returns o [Tq, Ha, dv] fp32, or written into
    ``out`` (any float dtype, rounded once from the fp32 result: no second pass to cast or copy it).
    ``tiles`` (BLOCK_M, BLOCK_N, num_warps, num_stages) None: autotuned."""
    return _launch(q, latent, w_kv_b, kv_lora_rank, nope_dim, scale, tiles, 1, None, context_len, latent.shape[0],
                   q.shape[0], out)


def mla_prefill_varlen(q: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor, seqs: torch.Tensor, max_tq: int,
                       kv_lora_rank: int, nope_dim: int, scale: float, tiles: dict | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """``mla_prefill`` of many sequences in one launch (and one key expansion): q [sum Tq, Ha,
    dn+dr] their new tokens back to back, latent [sum S, rkv+dr] their cached + new latents back to
    back, ``seqs`` [N, 4] int32 on the device: (first query row, first latent row, context, new
    tokens) a sequence; ``max_tq`` the longest one's new tokens (host). A chunked-prefill step of
    many prompts took ~7 launches a prompt a layer the other way. ``out``: as ``mla_prefill``'s."""
    return _launch(q, latent, w_kv_b, kv_lora_rank, nope_dim, scale, tiles, seqs.shape[0], seqs, 0, 0, max_tq, out)

"""KDA's short causal depthwise convolution over a varlen batch in two Triton launches.

The torch reference (``short_conv.short_conv_ref``) loops over prefill sequences, concatenating
each one's conv state with its transposed inputs in fp32 and running a generic depthwise conv: on
kimi-linear-48b an 8K-token prefill spent ~45 ms of its 295 ms there (RESULTS.md, sixth session).
Here one program covers a [tokens x channels] tile of the whole flat batch: each token finds its
sequence, reads the W-1 inputs before it from the batch or, before the sequence's first new token,
from the sequence's conv-state slot (zeros without cached context), and applies SiLU before one
rounding. A second launch then writes each sequence's new state (its last W-1 pre-conv inputs);
it must follow the first, which still reads the old states.

Output columns can be laid out in planes: with ``plane`` = P the [T, 3P] result is stored as three
contiguous [T, P] blocks (q, k, v), which fla's chunk kernels take without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..model.batch import ForwardBatch


@triton.jit
def _short_conv_kernel(X, WEIGHT, STATE, OUT, TOKEN_SEQ, QSTART, SLOTS, HAS_CTX, T, C, PLANE,
                       stride_xt, stride_ss, stride_sc, stride_sw, stride_op, stride_ot,
                       W: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       TILE_C: tl.constexpr, INTERIOR_FAST: tl.constexpr = False,
                       CHANNELS_FIRST: tl.constexpr = False, NORM_C=0, NORM_EPS=1e-6, NORM_HEADS: tl.constexpr = False):
    """Program: TILE_C channels (<= BLOCK_C, a power of two; with NORM_HEADS one head) of BLOCK_T tokens."""
    if CHANNELS_FIRST:  # neighbouring programs take neighbouring channels of the same tokens
        n_cb = tl.cdiv(C, TILE_C)
        pid_t, pid_c = tl.program_id(0) // n_cb, tl.program_id(0) % n_cb
    else:
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_C)
    c = pid_c * TILE_C + lane
    tmask, cmask = t < T, (c < C) & (lane < TILE_C)
    seq = tl.load(TOKEN_SEQ + t, mask=tmask, other=0)
    pos = t - tl.load(QSTART + seq)  # position among the sequence's new tokens
    live = tmask[:, None] & cmask[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    # Interior tiles (every token with W-1 inputs before it in this step: all but a sequence's first
    # tile) read no conv state: the state path's per-element gathers (channel stride W-1, no vector
    # loads) cost instructions in every tile even when masked off.
    if INTERIOR_FAST and tl.min(tl.where(tmask, pos, W), 0) >= W - 1:
        for w in tl.static_range(W):
            xv = tl.load(X + (t - (W - 1) + w).to(tl.int64)[:, None] * stride_xt + c[None, :], mask=live,
                         other=0.0).to(tl.float32)
            acc += xv * tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0)[None, :]
    else:
        slot = tl.load(SLOTS + seq).to(tl.int64)
        has_ctx = tl.load(HAS_CTX + seq) != 0
        for w in tl.static_range(W):
            src = pos - (W - 1) + w  # < 0: an input from before this step, held in the conv state
            in_batch = (src >= 0)[:, None]
            xv = tl.load(X + (t - (W - 1) + w).to(tl.int64)[:, None] * stride_xt + c[None, :],
                         mask=live & in_batch, other=0.0).to(tl.float32)
            sv = tl.load(STATE + slot[:, None] * stride_ss + c[None, :] * stride_sc + (W - 1 + src)[:, None] * stride_sw,
                         mask=live & ~in_batch & has_ctx[:, None], other=0.0).to(tl.float32)
            acc += (xv + sv) * tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if NORM_HEADS:  # a tile is one head wide (TILE_C = head dim): L2-normalise the first NORM_C channels' heads
        if pid_c * TILE_C < NORM_C:  # (lanes past the head hold zeros)
            acc = acc / tl.sqrt(tl.sum(acc * acc, 1) + NORM_EPS)[:, None]
    out = OUT + (c // PLANE)[None, :] * stride_op + t.to(tl.int64)[:, None] * stride_ot + (c % PLANE)[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=live)


@triton.jit
def _short_conv_state_kernel(X, STATE, QSTART, SLOTS, HAS_CTX, C, stride_xt, stride_ss, stride_sc, stride_sw,
                             W: tl.constexpr, W_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """New state of sequence n = the last W-1 entries of [old state ; new inputs]."""
    n = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    start = tl.load(QSTART + n)
    qlen = tl.load(QSTART + n + 1) - start
    slot = tl.load(SLOTS + n).to(tl.int64)
    j = tl.arange(0, W_P)
    has_ctx = (tl.zeros([W_P, 1], tl.int32) + tl.load(HAS_CTX + n)) != 0
    idx = qlen + j  # index into [old state (W-1) ; new inputs (qlen)]
    live = (j < W - 1)[:, None] & (c < C)[None, :]
    in_batch = (idx >= W - 1)[:, None]
    xv = tl.load(X + (start + idx - (W - 1)).to(tl.int64)[:, None] * stride_xt + c[None, :],
                 mask=live & in_batch, other=0.0)
    sv = tl.load(STATE + slot * stride_ss + c[None, :] * stride_sc + idx[:, None] * stride_sw,
                 mask=live & ~in_batch & has_ctx, other=0.0)
    new = tl.where(in_batch, xv.to(STATE.dtype.element_ty), sv)
    tl.debug_barrier()  # every old entry is read (by whichever thread) before any is overwritten
    tl.store(STATE + slot * stride_ss + c[None, :] * stride_sc + j[:, None] * stride_sw, new, mask=live)


# The conv's [tokens x channels] tile and warps, interior tiles without the conv-state path
# (INTERIOR_FAST) and programs in channel-block-first order (CHANNELS_FIRST), from
# bench/kernels_prefill.py's sweep at 8K tokens on the H200: 32 x 128 at 4 warps with both 0.311 ms
# (30 % of copy) against 0.416 (23 %) for the old 32 x 64 without them (RESULTS.md seventeenth session).
CONV_BLOCK_T, CONV_BLOCK_C, CONV_WARPS = 32, 128, 4
CONV_INTERIOR_FAST = True
CONV_CHANNELS_FIRST = True


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch,
                      silu: bool = True, plane: int | None = None, norm: tuple[int, int] | None = None,
                      eps: float = 1e-6) -> torch.Tensor:
    """``short_conv_ref`` (then SiLU when ``silu``) for x [T, C] (rows may be strided), weight
    [C, W] fp32, conv_state [num_slots, C, W-1] (any strides; updated in place). Returns the
    [T, C] result in x's dtype as C/P contiguous planes [C/P, T, P] (``plane`` P divides C; None: C).
    ``norm`` = (channels N, head dim D): the first N channels L2-normalised per head of D
    (x / sqrt(sum x^2 + eps), KDA's q and k) before the one rounding; tiles are then one head wide
    (D channels in a power-of-two tile: the bundled tiny model's KDA heads are 48 wide)."""
    T, C = x.shape
    W = weight.shape[-1]
    plane = plane or C
    if C % plane or x.stride(-1) != 1:
        raise ValueError(f"plane {plane} must divide {C} channels, and x's channels must be dense")
    tile_c = block_c = CONV_BLOCK_C
    if norm is not None:
        tile_c, block_c = norm[1], triton.next_power_of_2(norm[1])
        if norm[0] % tile_c:
            raise ValueError(f"norm heads of {tile_c} must tile the {norm[0]} normalised channels")
    planes = torch.empty(C // plane, T, plane, dtype=x.dtype, device=x.device)
    if T:
        w = weight.float().contiguous()
        st = conv_state
        n_t, n_c = triton.cdiv(T, CONV_BLOCK_T), triton.cdiv(C, tile_c)
        _short_conv_kernel[(n_t * n_c,) if CONV_CHANNELS_FIRST else (n_t, n_c)](
            x, w, st, planes, batch.token_seq, batch.query_start, batch.kda_slots, batch.has_context, T, C, plane,
            x.stride(0), st.stride(0), st.stride(1), st.stride(2), planes.stride(0), planes.stride(1),
            W=W, SILU=silu, BLOCK_T=CONV_BLOCK_T, BLOCK_C=block_c, TILE_C=tile_c, INTERIOR_FAST=CONV_INTERIOR_FAST,
            CHANNELS_FIRST=CONV_CHANNELS_FIRST, NORM_C=norm[0] if norm else 0, NORM_EPS=eps,
            NORM_HEADS=norm is not None, num_warps=CONV_WARPS)
        _short_conv_state_kernel[(batch.num_seqs, triton.cdiv(C, 256))](
            x, st, batch.query_start, batch.kda_slots, batch.has_context, C,
            x.stride(0), st.stride(0), st.stride(1), st.stride(2),
            W=W, W_P=triton.next_power_of_2(W - 1), BLOCK_C=256)
    return planes

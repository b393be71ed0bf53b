"""KDA's short causal depthwise convolution over a varlen batch in two Triton launches.

The torch reference (``short_conv.short_conv_ref``) loops over prefill sequences, concatenating
each one's conv state with its transposed inputs in fp32 and running a generic depthwise conv: on
kimi-linear-48b an 8K-token prefill spent ~45 ms of its 295 ms there (RESULTS.md, sixth session).
Here the work splits by where a token's window lies:
- ``_short_conv_kernel``, a stencil over the flat batch: a program covers a [tokens x channels]
  tile, reads the W shifted rows of x as vectors and writes every token whose W-1 predecessors are
  in its own sequence's new tokens; it never reads the conv state, so no tile pays for its gathers
  (the thirty-eighth session's reason: with a state path in every tile the kernel took 221
  registers a thread, two programs an SM, and ran at 29-30 % of copy).
- ``_short_conv_heads_kernel``, a program per (sequence, channel tile): the sequence's first W-1
  outputs, whose windows reach into its conv-state slot (zeros without cached context), then the
  slot's new state (its last W-1 pre-conv inputs). The two launches touch disjoint outputs and only
  the second reads or writes the state, so they need no order.
SiLU (and the optional q/k L2 norm) is applied before the one rounding.

Output columns can be laid out in planes: with ``plane`` = P the [T, 3P] result is stored as three
contiguous [T, P] blocks (q, k, v), which fla's chunk kernels take without a copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..model.batch import ForwardBatch
from .autotune import interpreted


@triton.jit
def _finish(acc, OUT, t, c, rows, cmask, pid_c, PLANE, stride_op, stride_ot, SILU: tl.constexpr,
            TILE_C: tl.constexpr, NORM_C, NORM_EPS, NORM_HEADS: tl.constexpr, FAST_DIV: tl.constexpr):
    """SiLU, the per-head L2 norm of the first NORM_C channels (a tile is then one head wide; lanes
    past the head hold zeros), one rounding, and the store of the ``rows`` into the planes.
    FAST_DIV: SiLU's division as div.approx (2 ulp; the interpreter has no libdevice)."""
    if SILU:
        if FAST_DIV:
            acc = libdevice.fast_dividef(acc, 1.0 + tl.exp(-acc))
        else:
            acc = acc / (1.0 + tl.exp(-acc))
    if NORM_HEADS:
        if pid_c * TILE_C < NORM_C:
            acc = acc * tl.math.rsqrt(tl.sum(acc * acc, 1) + NORM_EPS)[:, None]
    out = OUT + (c // PLANE)[None, :] * stride_op + t.to(tl.int64)[:, None] * stride_ot + (c % PLANE)[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=rows[:, None] & cmask[None, :])


@triton.jit
def _short_conv_kernel(X, WEIGHT, OUT, TOKEN_SEQ, QSTART, T, C, PLANE, stride_xt, stride_op, stride_ot,
                       W: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       TILE_C: tl.constexpr, CHANNELS_FIRST: tl.constexpr = False, NORM_C=0, NORM_EPS=1e-6,
                       NORM_HEADS: tl.constexpr = False, FAST_DIV: tl.constexpr = False):
    """Program: TILE_C channels (<= BLOCK_C, a power of two; with NORM_HEADS one head) of BLOCK_T
    tokens; a sequence's first W-1 tokens are left to ``_short_conv_heads_kernel``."""
    if CHANNELS_FIRST:  # neighbouring programs take neighbouring channels of the same tokens
        n_cb = tl.cdiv(C, TILE_C)
        pid_t, pid_c = tl.program_id(0) // n_cb, tl.program_id(0) % n_cb
    else:
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    lane = tl.arange(0, BLOCK_C)
    c = pid_c * TILE_C + lane
    tmask, cmask = t < T, (c < C) & (lane < TILE_C)
    acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
    for w in tl.static_range(W):
        src = t - (W - 1) + w  # rows before the batch, or of another sequence, feed only rows not kept
        xv = tl.load(X + src.to(tl.int64)[:, None] * stride_xt + c[None, :],
                     mask=(tmask & (src >= 0))[:, None] & cmask[None, :], other=0.0)
        acc += xv.to(tl.float32) * tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0)[None, :]
    seq = tl.load(TOKEN_SEQ + t, mask=tmask, other=0)
    keep = tmask & (t - tl.load(QSTART + seq, mask=tmask, other=0) >= W - 1)
    _finish(acc, OUT, t, c, keep, cmask, pid_c, PLANE, stride_op, stride_ot, SILU, TILE_C, NORM_C, NORM_EPS,
            NORM_HEADS, FAST_DIV)


@triton.jit
def _window_entry(X, STATE, i, c, live, start, qlen, slot, has_ctx, stride_xt, stride_ss, stride_sc, stride_sw,
                  W: tl.constexpr):
    """Entries ``i`` [R] of a sequence's [old conv state (W-1) ; new inputs (qlen)] for channels c,
    in the state's dtype ([R, BLOCK_C]; entries of a state without context are zeros)."""
    in_batch = (i >= W - 1)[:, None]
    xv = tl.load(X + (start + i - (W - 1)).to(tl.int64)[:, None] * stride_xt + c[None, :],
                 mask=live & in_batch & (i - (W - 1) < qlen)[:, None], other=0.0)
    sv = tl.load(STATE + slot * stride_ss + c[None, :] * stride_sc + i[:, None] * stride_sw,
                 mask=live & ~in_batch & has_ctx, other=0.0)
    return tl.where(in_batch, xv.to(STATE.dtype.element_ty), sv)


@triton.jit
def _short_conv_heads_kernel(X, WEIGHT, STATE, OUT, QSTART, SLOTS, HAS_CTX, C, PLANE, stride_xt, stride_ss,
                             stride_sc, stride_sw, stride_op, stride_ot, W: tl.constexpr, W_P: tl.constexpr,
                             SILU: tl.constexpr, BLOCK_C: tl.constexpr, TILE_C: tl.constexpr, NORM_C=0,
                             NORM_EPS=1e-6, NORM_HEADS: tl.constexpr = False, FAST_DIV: tl.constexpr = False):
    """Program (sequence n, TILE_C channels): outputs of the sequence's first min(W-1, qlen) tokens
    from its conv state and new inputs, then its new state (the last W-1 entries of [old state ;
    new inputs]), once every old entry is read."""
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    lane = tl.arange(0, BLOCK_C)
    c = pid_c * TILE_C + lane
    cmask = (c < C) & (lane < TILE_C)
    start = tl.load(QSTART + n)
    qlen = tl.load(QSTART + n + 1) - start
    slot = tl.load(SLOTS + n).to(tl.int64)
    j = tl.arange(0, W_P)  # the sequence's token j (an output row) and new-state entry j
    has_ctx = (tl.zeros([W_P, 1], tl.int32) + tl.load(HAS_CTX + n)) != 0
    rows = (j < W - 1) & (j < qlen)
    live = rows[:, None] & cmask[None, :]
    acc = tl.zeros([W_P, BLOCK_C], tl.float32)
    for w in tl.static_range(W):  # token j's window: entries j .. j + W-1
        e = _window_entry(X, STATE, j + w, c, live, start, qlen, slot, has_ctx, stride_xt, stride_ss, stride_sc,
                          stride_sw, W)
        acc += e.to(tl.float32) * tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0)[None, :]
    live_state = (j < W - 1)[:, None] & cmask[None, :]
    new = _window_entry(X, STATE, qlen + j, c, live_state, start, qlen, slot, has_ctx, stride_xt, stride_ss,
                        stride_sc, stride_sw, W)
    tl.debug_barrier()  # every old entry is read (by whichever thread) before any is overwritten
    tl.store(STATE + slot * stride_ss + c[None, :] * stride_sc + j[:, None] * stride_sw, new, mask=live_state)
    _finish(acc, OUT, start + j, c, rows, cmask, pid_c, PLANE, stride_op, stride_ot, SILU, TILE_C, NORM_C, NORM_EPS,
            NORM_HEADS, FAST_DIV)


# The stencil's [tokens x channels] tile and warps, and programs in channel-block-first order
# (CHANNELS_FIRST), from bench/kernels_prefill.py's sweep at 8K tokens on the H200.
CONV_BLOCK_T, CONV_BLOCK_C, CONV_WARPS = 32, 128, 4
CONV_CHANNELS_FIRST = True
CONV_FAST_DIV = True


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
        norm_c = norm[0] if norm else 0
        fast = CONV_FAST_DIV and not interpreted()
        # (no order needed; the heads first, so that the stencil overwrites any head row it should not)
        _short_conv_heads_kernel[(batch.num_seqs, n_c)](
            x, w, st, planes, batch.query_start, batch.kda_slots, batch.has_context, C, plane, x.stride(0),
            st.stride(0), st.stride(1), st.stride(2), planes.stride(0), planes.stride(1), W=W,
            W_P=triton.next_power_of_2(W - 1), SILU=silu, BLOCK_C=block_c, TILE_C=tile_c, NORM_C=norm_c,
            NORM_EPS=eps, NORM_HEADS=norm is not None, FAST_DIV=fast)
        _short_conv_kernel[(n_t * n_c,) if CONV_CHANNELS_FIRST else (n_t, n_c)](
            x, w, planes, batch.token_seq, batch.query_start, T, C, plane, x.stride(0), planes.stride(0),
            planes.stride(1), W=W, SILU=silu, BLOCK_T=CONV_BLOCK_T, BLOCK_C=block_c, TILE_C=tile_c,
            CHANNELS_FIRST=CONV_CHANNELS_FIRST, NORM_C=norm_c, NORM_EPS=eps, NORM_HEADS=norm is not None,
            FAST_DIV=fast, num_warps=CONV_WARPS)
    return planes

"""KDA's short causal depthwise convolution over a varlen batch in two Triton launches.

The torch reference (``short_conv.short_conv_ref``) loops over prefill sequences, concatenating
each one's conv state with its transposed inputs in fp32 and running a generic depthwise conv: on
kimi-linear-48b an 8K-token prefill spent ~45 ms of its 295 ms there (RESULTS.md, sixth session).
Here the work splits by where a token's window lies:
- ``_short_conv_kernel``, a stencil over the flat batch: a program slides down ROWS tokens of a
  channel tile with the last W-1 rows in registers (each x row loaded and upcast once), and writes
  every token as if the batch were one sequence; it never reads the conv state nor where
  sequences start. (Thirty-eighth session: the old one-kernel form held the state path in every tile, 221
  registers a thread, and ran at 29 % of copy; [tokens x channels] tiles without it 55-62 %;
  sliding rows 58-64 %, 65-73 % without the q/k norm, while they still tested each row's sequence
  start: the form without that test is untimed.)
- ``_short_conv_heads_kernel``, a program per (sequence, channel tile), launched second: it
  rewrites the sequence's first W-1 outputs, whose windows reach into its conv-state slot (zeros
  without cached context), then writes the slot's new state (its last W-1 pre-conv inputs).
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
def _channels(pid_c, C, BLOCK_C: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr):
    """(channels [BLOCK_C], their mask, the first channel) of channel tile ``pid_c``: BLOCK_C // HEAD_P
    groups (heads, for the norm) of HEAD channels, each in HEAD_P lanes (a power of two: the bundled
    tiny model's KDA heads are 48 wide); dense, hence vector loads, where HEAD == HEAD_P."""
    lane = tl.arange(0, BLOCK_C)
    first = pid_c * (BLOCK_C // HEAD_P * HEAD)
    if HEAD == HEAD_P:
        c = first + lane
        return c, c < C, first
    c = first + lane // HEAD_P * HEAD + lane % HEAD_P
    return c, (c < C) & (lane % HEAD_P < HEAD), first


@triton.jit
def _x_row(X, t, c, cmask, T, stride_xt):
    """Row ``t`` of x at channels c (zeros outside the batch). (The mask as a select: Triton's
    interpreter rejects a vector mask and-ed with a scalar.)"""
    return tl.load(X + t.to(tl.int64) * stride_xt + c, mask=tl.where((t >= 0) & (t < T), cmask, False), other=0.0)


@triton.jit
def _finish(acc, OUT, t, c, rows, cmask, first_c, PLANE, stride_op, stride_ot, SILU: tl.constexpr,
            BLOCK_C: tl.constexpr, HEAD_P: tl.constexpr, NORM_C, NORM_EPS, NORM_HEADS: tl.constexpr,
            FAST_SILU: tl.constexpr):
    """acc [R, BLOCK_C] (tokens ``t`` [R], channels ``c``): SiLU, the L2 norm of each group of the
    tiles below NORM_C (a tile starting at channel ``first_c`` is all q/k or all v), one rounding,
    and the store of the ``rows`` [R] into the planes. FAST_SILU: SiLU's exp and division as
    ex2.approx.ftz and div.approx (2 ulp, no denormal fix-ups; the interpreter has no libdevice)."""
    if SILU:
        if FAST_SILU:
            acc = libdevice.fast_dividef(acc, 1.0 + libdevice.fast_expf(-acc))
        else:
            acc = acc / (1.0 + tl.exp(-acc))
    if NORM_HEADS:  # (lanes past a head hold zeros; a select, not a branch: the two sides' layouts would meet
        R: tl.constexpr = acc.shape[0]  # in shared memory)
        g = tl.reshape(acc, [R, BLOCK_C // HEAD_P, HEAD_P])
        scale = tl.where(first_c < NORM_C, tl.math.rsqrt(tl.sum(g * g, 2) + NORM_EPS), 1.0)
        acc = tl.reshape(g * scale[:, :, None], [R, BLOCK_C])
    out = OUT + (c // PLANE)[None, :] * stride_op + t.to(tl.int64)[:, None] * stride_ot + (c % PLANE)[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=rows[:, None] & cmask[None, :])


@triton.jit
def _short_conv_kernel(X, WEIGHT, OUT, T, C, PLANE, stride_xt, stride_op, stride_ot,
                       W: tl.constexpr, SILU: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_C: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
                       CHANNELS_FIRST: tl.constexpr = False, NORM_C=0, NORM_EPS=1e-6,
                       NORM_HEADS: tl.constexpr = False, FAST_SILU: tl.constexpr = False):
    """Program: ROWS consecutive tokens of a channel tile (GROUP rows loaded at once, a divisor of
    ROWS), a row at a time, the W-1 rows before it held in registers: each x row is loaded and
    upcast once (and W-1 more a program). Every token is written, a sequence's first W-1 from
    windows that reach into the sequence before it: ``_short_conv_heads_kernel`` rewrites those."""
    if CHANNELS_FIRST:  # neighbouring programs take neighbouring channels of the same tokens
        n_cb = tl.cdiv(C, BLOCK_C // HEAD_P * HEAD)
        pid_t, pid_c = tl.program_id(0) // n_cb, tl.program_id(0) % n_cb
    else:
        pid_t, pid_c = tl.program_id(0), tl.program_id(1)
    c, cmask, first_c = _channels(pid_c, C, BLOCK_C, HEAD, HEAD_P)
    t0 = pid_t * ROWS
    wts = ()
    for w in tl.static_range(W):
        wts = wts + (tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0),)
    win = ()  # rows t0 - (W-1) .. t0 - 1 (before the batch: zeros)
    for w in tl.static_range(W - 1):
        win = win + (_x_row(X, t0 - (W - 1) + w, c, cmask, T, stride_xt).to(tl.float32),)
    one = tl.zeros([1], tl.int32)
    for g in tl.static_range(ROWS // GROUP):
        # A group's rows are loaded before any of its outputs is stored: a load cannot move above a
        # store (x and the planes might alias), so row by row each load waited for the row before.
        xs = ()
        for r in tl.static_range(GROUP):
            xs = xs + (_x_row(X, t0 + g * GROUP + r, c, cmask, T, stride_xt),)
        for r in tl.static_range(GROUP):
            xr = xs[r].to(tl.float32)
            acc = xr * wts[W - 1]
            for w in tl.static_range(W - 1):
                acc += win[w] * wts[w]
            t = one + (t0 + g * GROUP + r)
            _finish(acc[None, :], OUT, t, c, t < T, cmask, first_c, PLANE, stride_op, stride_ot, SILU, BLOCK_C,
                    HEAD_P, NORM_C, NORM_EPS, NORM_HEADS, FAST_SILU)
            win = win[1:] + (xr,)


@triton.jit
def _window_entry(X, STATE, i, c, live, start, qlen, slot, has_ctx, stride_xt, stride_ss, stride_sc, stride_sw,
                  W: tl.constexpr):
    """Entries ``i`` [R] of a sequence's [old conv state (W-1) ; new inputs (qlen)] for channels c,
    in fp32 ([R, BLOCK_C]; entries of a state without context are zeros)."""
    in_batch = (i >= W - 1)[:, None]
    xv = tl.load(X + (start + i - (W - 1)).to(tl.int64)[:, None] * stride_xt + c[None, :],
                 mask=live & in_batch & (i - (W - 1) < qlen)[:, None], other=0.0)
    sv = tl.load(STATE + slot * stride_ss + c[None, :] * stride_sc + i[:, None] * stride_sw,
                 mask=live & ~in_batch & has_ctx, other=0.0)
    return tl.where(in_batch, xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _short_conv_heads_kernel(X, WEIGHT, STATE, OUT, QSTART, SLOTS, HAS_CTX, C, PLANE, stride_xt, stride_ss,
                             stride_sc, stride_sw, stride_op, stride_ot, W: tl.constexpr, W_P: tl.constexpr,
                             SILU: tl.constexpr, BLOCK_C: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
                             NORM_C=0, NORM_EPS=1e-6, NORM_HEADS: tl.constexpr = False,
                             FAST_SILU: tl.constexpr = False):
    """Program (sequence n, channel tile): outputs of the sequence's first min(W-1, qlen) tokens
    from its conv state and new inputs, then its new state (the last W-1 entries of [old state ;
    new inputs]), once every old entry is read."""
    n = tl.program_id(0)
    pid_c = tl.program_id(1)
    c, cmask, first_c = _channels(pid_c, C, BLOCK_C, HEAD, HEAD_P)
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
        acc += e * tl.load(WEIGHT + c * W + w, mask=cmask, other=0.0)[None, :]
    live_state = (j < W - 1)[:, None] & cmask[None, :]
    new = _window_entry(X, STATE, qlen + j, c, live_state, start, qlen, slot, has_ctx, stride_xt, stride_ss,
                        stride_sc, stride_sw, W)
    tl.debug_barrier()  # every old entry is read (by whichever thread) before any is overwritten
    tl.store(STATE + slot * stride_ss + c[None, :] * stride_sc + j[:, None] * stride_sw, new.to(STATE.dtype.element_ty),
             mask=live_state)
    _finish(acc, OUT, start + j, c, rows, cmask, first_c, PLANE, stride_op, stride_ot, SILU, BLOCK_C, HEAD_P, NORM_C,
            NORM_EPS, NORM_HEADS, FAST_SILU)


# The stencil's rows a program, rows loaded at once, channel lanes (whole 128-wide heads for the q/k norm)
# and warps, and programs in channel-block-first order (CHANNELS_FIRST), from bench/kernels_prefill.py's sweep
# at 8K tokens on the H200 (RESULTS.md thirty-ninth session): 16 rows, 8 at once, 512 lanes, 4 warps at
# 71 / 83 % of copy (kimi-linear / K3 widths, with the q/k norm; 32 rows 68 / 78 %), 80 / 90 % without it.
CONV_ROWS, CONV_GROUP, CONV_BLOCK_C, CONV_WARPS = 16, 8, 512, 4
CONV_CHANNELS_FIRST = True
CONV_FAST_SILU = True


def short_conv_triton(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, batch: ForwardBatch,
                      silu: bool = True, plane: int | None = None, norm: tuple[int, int] | None = None,
                      eps: float = 1e-6) -> torch.Tensor:
    """``short_conv_ref`` (then SiLU when ``silu``) for x [T, C] (rows may be strided), weight
    [C, W] fp32, conv_state [num_slots, C, W-1] (any strides; updated in place). Returns the
    [T, C] result in x's dtype as C/P contiguous planes [C/P, T, P] (``plane`` P divides C; None: C).
    ``norm`` = (channels N, head dim D): the first N channels L2-normalised per head of D
    (x / sqrt(sum x^2 + eps), KDA's q and k) before the one rounding; tiles then hold whole heads
    (each in a power-of-two run of lanes: the bundled tiny model's KDA heads are 48 wide), as many
    as divide N / D."""
    T, C = x.shape
    W = weight.shape[-1]
    plane = plane or C
    if C % plane or x.stride(-1) != 1:
        raise ValueError(f"plane {plane} must divide {C} channels, and x's channels must be dense")
    head = head_p = block_c = CONV_BLOCK_C
    if norm is not None:
        head, head_p = norm[1], triton.next_power_of_2(norm[1])
        if norm[0] % head:
            raise ValueError(f"norm heads of {head} must tile the {norm[0]} normalised channels")
        groups = max(CONV_BLOCK_C // head_p, 1)
        while (norm[0] // head) % groups:
            groups //= 2
        block_c = groups * head_p
    tile_c = block_c // head_p * head
    group = min(CONV_GROUP, CONV_ROWS)
    if CONV_ROWS % group:
        raise ValueError(f"rows a program ({CONV_ROWS}) must be groups of {group}")
    planes = torch.empty(C // plane, T, plane, dtype=x.dtype, device=x.device)
    if T:
        w = weight.float().contiguous()
        st = conv_state
        n_t, n_c = triton.cdiv(T, CONV_ROWS), triton.cdiv(C, tile_c)
        norm_c = norm[0] if norm else 0
        fast = CONV_FAST_SILU and not interpreted()
        _short_conv_kernel[(n_t * n_c,) if CONV_CHANNELS_FIRST else (n_t, n_c)](
            x, w, planes, T, C, plane, x.stride(0), planes.stride(0), planes.stride(1), W=W, SILU=silu, ROWS=CONV_ROWS, GROUP=group, BLOCK_C=block_c, HEAD=head, HEAD_P=head_p,
            CHANNELS_FIRST=CONV_CHANNELS_FIRST, NORM_C=norm_c, NORM_EPS=eps, NORM_HEADS=norm is not None,
            FAST_SILU=fast, num_warps=CONV_WARPS)
        # second: over the stencil's rows of each sequence's first W-1 tokens
        _short_conv_heads_kernel[(batch.num_seqs, n_c)](
            x, w, st, planes, batch.query_start, batch.kda_slots, batch.has_context, C, plane, x.stride(0),
            st.stride(0), st.stride(1), st.stride(2), planes.stride(0), planes.stride(1), W=W,
            W_P=triton.next_power_of_2(W - 1), SILU=silu, BLOCK_C=block_c, HEAD=head, HEAD_P=head_p, NORM_C=norm_c,
            NORM_EPS=eps, NORM_HEADS=norm is not None, FAST_SILU=fast, num_warps=CONV_WARPS)
    return planes

"""Fused KDA decode step in Triton: gate activation, q/k L2 norms, the delta-rule update and the
output, with the fp32 state read and written in place at each sequence's pool slot.

Decode is bound by the state traffic (8 D^2 bytes per head per token, seed 002), so everything
else rides along in registers: one program per (sequence, head, block of value columns) loads its
[K, BV] state tile once, applies the decay, the rank-1 delta update and the read-out, and writes
the tile back. q, k are the post-conv activations (normalised here), ``f`` the gate
pre-activation without dt_bias, ``b`` the beta logits.

``kda_decode`` is that core step alone (a bandwidth probe for bench/); ``kda_decode_fused`` is
the whole mixer step the model runs: short-conv update + SiLU, gates, norms, the delta rule and
the gated RMSNorm, one program per (sequence, head) so the conv state it rewrites is its own.

Reference: ``kda_ref.kda_recurrent_ref`` + ``kda_ref.kda_gate`` (and the mixer's torch path).
Checked on CPU under ``TRITON_INTERPRET=1`` (tests/test_kda_decode_triton.py); timed on the H200
by bench/kernels_kda_decode.py (RESULTS.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .autotune import sm_count
from .pdl import pdl_start
from .tickets import last_arrival, tickets


# One program a head through kda_decode_gluon (the state copied to shared memory while the convs,
# gates and norms run): checked, but 78 / 84 % of copy at N = 64 / 256 against this kernel's
# 81 / 86 %, both heads fastest (RESULTS.md forty-sixth session), so off.
GLUON_FUSED = False
# The fused grid's launch order, fastest first: "sequences" (grid (N, H, parts)), "heads" ((H, N,
# parts): consecutive programs on neighbouring state blocks of one slot) or "memory" ((parts, H,
# N): a head's programs side by side, then its neighbours). Heads fastest: 80 / 85 % of copy at N
# 64 / 256 against 80 / 83 % (the state tiles alone: 92 / 96 % in memory order, 90 / 92 % sequences
# fastest; RESULTS.md forty-fifth session).
LAUNCH_ORDER = "heads"
_ORDERS = {"sequences": 0, "heads": 1, "memory": 2}
# Registers a thread for a program a head (4 warps): 168 keeps three programs an SM (sm_90 allocates
# a warp's registers in 256s: 169-176 a thread leaves room for two). Triton 3.6 gives the kernel
# 177 uncapped (the output norm's gate held from the prologue): 71 / 73 % of copy at N 64 / 256;
# capped, none spill: 82 / 86 % (RESULTS.md forty-sixth session).
HEAD_MAXNREG = 168


@triton.jit
def _decay_beta(F_ROW, BETA_AT, A_LOG, DT_BIAS, h, lower_bound, D: tl.constexpr, USE_LOWER_BOUND: tl.constexpr):
    """A head's per-key-channel decay exp(g) and its beta, from their pre-activations (``kda_ref.kda_gate``)."""
    dk = tl.arange(0, D)
    f = tl.load(F_ROW + dk).to(tl.float32) + tl.load(DT_BIAS + h * D + dk)
    a = tl.exp(tl.load(A_LOG + h))
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * f)
    else:
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(f)))
    return tl.exp(g), tl.sigmoid(tl.load(BETA_AT).to(tl.float32))


@triton.jit
def _delta_rule(s, has, q, k, decay, beta, v):
    """One token through a [K, BV] block of a head's state: S <- decay * S + beta k (v - k^T decay
    S)^T, o = S^T q. Returns (S, o). ``has`` 0: a fresh sequence, whose slot may hold anything."""
    s = tl.where(has > 0, s, 0.0) * decay[:, None]
    r = v - tl.sum(s * k[:, None], 0)
    s = s + beta * k[:, None] * r[None, :]
    return s, tl.sum(s * q[:, None], 0)


@triton.jit
def _kda_decode_kernel(
    Q, K, V, F, BETA, A_LOG, DT_BIAS, STATE, SLOTS, O,
    stride_state_slot, scale, lower_bound, H,
    D: tl.constexpr, BV: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_start(USE_PDL)
    vb = tl.program_id(0)  # (memory order: a head's value blocks side by side, then its neighbours)
    h = tl.program_id(1)
    n = tl.program_id(2)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    base = (n * H + h) * D
    q = tl.load(Q + base + dk).to(tl.float32)
    k = tl.load(K + base + dk).to(tl.float32)
    v = tl.load(V + base + dv).to(tl.float32)
    decay, beta = _decay_beta(F + base, BETA + n * H + h, A_LOG, DT_BIAS, h, lower_bound, D, USE_LOWER_BOUND)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)

    slot = tl.load(SLOTS + n).to(tl.int64)
    s_ptr = STATE + slot * stride_state_slot + h * D * D + dk[:, None] * D + dv[None, :]
    s, o = _delta_rule(tl.load(s_ptr), 1.0, q, k, decay, beta, v)  # [D, BV] fp32, rows = key channels
    tl.store(s_ptr, s)
    tl.store(O + base + dv, o)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, scale: float,
               state: torch.Tensor, slots: torch.Tensor, block_v: int = 64) -> torch.Tensor:
    """q, k, v, f: [N, H, D]; beta_logits [N, H]; A_log [H]; dt_bias [H*D]; state [num_slots, H, D, D]
    fp32 (each slot a contiguous [H, D, D] block; the slot stride is free, so pool views work);
    slots [N]. Updates the state in place; returns o [N, H, D] fp32."""
    N, H, D = q.shape
    if state.dtype != torch.float32 or state[0].stride() != (D * D, D, 1):
        raise ValueError("state must be fp32 with contiguous [H, D, D] slots")
    q, k, v, f = (x.contiguous() for x in (q, k, v, f))
    o = torch.empty(N, H, D, dtype=torch.float32, device=q.device)
    bv = min(block_v, D)
    _kda_decode_kernel[(D // bv, H, N)](
        q, k, v, f, beta_logits.contiguous(), A_log.float().contiguous(), dt_bias.float().contiguous(), state,
        slots, o, state.stride(0), scale, float(lower_bound) if lower_bound is not None else 0.0, H,
        D=D, BV=bv, USE_LOWER_BOUND=lower_bound is not None, **pdl.launch(o.device),
    )
    return o


@triton.jit
def _conv_window(X, CONV_W, CONV_STATE, n, slot, has, ch, stride_conv_slot, stride_x, W: tl.constexpr):
    """Loads only, for channels ``ch``: the conv window [conv state ; new input] (oldest first)
    times the conv weights, and the state shifted by one (what ``_conv_shift`` writes back).
    Returns (weighted window, shifted, ptr)."""
    wi = tl.arange(0, W)
    w = tl.load(CONV_W + ch[:, None] * W + wi[None, :])
    col = wi[None, :] + 0 * ch[:, None]  # [C, W] column index (masks must match the pointer shape)
    x_new = tl.load(X + n * stride_x + ch).to(tl.float32)
    cs_ptr = CONV_STATE + slot * stride_conv_slot + ch[:, None] * (W - 1) + wi[None, :]
    old = tl.where(has > 0, tl.load(cs_ptr, mask=col < W - 1, other=0.0).to(tl.float32), 0.0)  # fresh: zeros
    shifted = tl.where(has > 0, tl.load(cs_ptr + 1, mask=col < W - 2, other=0.0).to(tl.float32), 0.0)
    return tl.where(col == W - 1, x_new[:, None], old) * w, tl.where(col == W - 2, x_new[:, None], shifted), cs_ptr


@triton.jit
def _conv_shift(cs_ptr, shifted, W: tl.constexpr):
    """Writes the conv state shifted by one: only the program that owns these channels may, and
    only once every program that reads them has read."""
    col = tl.arange(0, W)[None, :] + tl.zeros(shifted.shape, tl.int32)
    tl.store(cs_ptr, shifted.to(cs_ptr.dtype.element_ty), mask=col < W - 1)


@triton.jit
def _silu_conv(weighted):
    """SiLU of the causal depthwise conv, from the weighted window."""
    u = tl.sum(weighted, 1)
    return u / (1.0 + tl.exp(-u))


@triton.jit
def _conv_silu(X, CONV_W, CONV_STATE, n, slot, has, ch, stride_conv_slot, stride_x, W: tl.constexpr):
    """Causal depthwise conv of channels ``ch`` with state, SiLU, the state shifted (its loads
    before its store)."""
    weighted, shifted, cs_ptr = _conv_window(X, CONV_W, CONV_STATE, n, slot, has, ch, stride_conv_slot, stride_x, W)
    _conv_shift(cs_ptr, shifted, W)
    return _silu_conv(weighted)


@triton.jit
def _head_gates(X, CONV_W, CONV_STATE, F, BETA, A_LOG, DT_BIAS, n, h, slot, has, stride_conv_slot, stride_x, stride_f,
                stride_b, scale, lower_bound, P, D: tl.constexpr, W: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
                SHIFT: tl.constexpr):
    """A head's short causal conv (with state) of its q and k channels, their L2 norms, the decay
    and beta: everything its value blocks share. ``slot``: int64. Every load is issued before the
    first conv-state store: a store waits for its data, so a load written after it would wait a
    round trip for the loads before it (q's conv, then k's, then the gates: 1 point of copy at N 64
    / 256, RESULTS.md forty-sixth session). Returns the shifted q / k conv rows too (unwritten
    unless SHIFT), for a head's last program to write."""
    dk = tl.arange(0, D)
    wq, sq, pq = _conv_window(X, CONV_W, CONV_STATE, n, slot, has, h * D + dk, stride_conv_slot, stride_x, W)
    wk, sk, pk = _conv_window(X, CONV_W, CONV_STATE, n, slot, has, P + h * D + dk, stride_conv_slot, stride_x, W)
    decay, beta = _decay_beta(F + n * stride_f + h * D, BETA + n * stride_b + h, A_LOG, DT_BIAS, h, lower_bound, D,
                              USE_LOWER_BOUND)
    q = _silu_conv(wq)
    k = _silu_conv(wk)
    if SHIFT:
        _conv_shift(pq, sq, W)
        _conv_shift(pk, sk, W)
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
    return q, k, decay, beta, sq, pq, sk, pk


@triton.jit
def _kda_decode_fused_kernel(
    X, CONV_W, CONV_STATE, HAS_CTX, F, BETA, A_LOG, DT_BIAS, GATE, ONORM_W, STATE, SLOTS, O_SCRATCH, SUMSQ, TICKETS, Y,
    stride_conv_slot, stride_state_slot, stride_x, stride_f, stride_b, stride_g, scale, lower_bound, eps, H,
    D: tl.constexpr, W: tl.constexpr, BV: tl.constexpr, BLOCKS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
    ORDER: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):
    """Program (sequence, head, part): the head's q/k conv, SiLU, gates and L2 norms, then BLOCKS
    value blocks of BV columns: v's conv and the state update. A head is D // (BV * BLOCKS)
    programs. One (BLOCKS = D // BV) normalises its own output; several recompute q and k (cheap
    next to the state) and the head's last to finish (a ticket per head, reset for the next call)
    does the gated RMSNorm and shifts the q/k conv state, which every program of the head has read
    by then. Several programs a head win when heads alone leave SMs idle (a batch-1 step:
    0.120 vs 0.168 ms on kimi-linear), one wins once heads fill the GPU (N >= 64: 79-82 % of
    copy vs 70-74 %; RESULTS.md eighth session)."""
    pdl_start(USE_PDL)
    if ORDER == 0:
        n = tl.program_id(0)
        h = tl.program_id(1)
        part = tl.program_id(2)
    elif ORDER == 1:
        n = tl.program_id(1)
        h = tl.program_id(0)
        part = tl.program_id(2)
    else:
        n = tl.program_id(2)
        h = tl.program_id(1)
        part = tl.program_id(0)
    PARTS: tl.constexpr = D // (BV * BLOCKS)
    P = H * D
    dk = tl.arange(0, D)
    head = n * H + h
    slot = tl.load(SLOTS + n).to(tl.int64)
    has = (tl.load(HAS_CTX + n) != 0).to(tl.float32)
    # the output norm's weight and gate, loaded with the prologue (no store before them)
    w_gate = tl.load(ONORM_W + dk) * tl.sigmoid(tl.load(GATE + n * stride_g + h * D + dk).to(tl.float32))
    q, k, decay, beta, sq, pq, sk, pk = _head_gates(X, CONV_W, CONV_STATE, F, BETA, A_LOG, DT_BIAS, n, h, slot, has,
                                                    stride_conv_slot, stride_x, stride_f, stride_b, scale, lower_bound,
                                                    P, D, W, USE_LOWER_BOUND, PARTS == 1)
    # ---- delta rule over this program's value blocks ------------------------------------------
    sumsq = 0.0
    for j in tl.static_range(BLOCKS):
        dv = (part * BLOCKS + j) * BV + tl.arange(0, BV)
        # The state tile before v's conv: no load moves above that conv's state store (the
        # compiler must assume they alias), and issued after it the tile waited on the conv (70-73 %
        # of copy at N >= 64); not before q and k either: held across their convs the kernel grew
        # to 3,160 SASS instructions a thread from 1,200 (bench/sass_mix.py) and ran at 43 %.
        s_ptr = STATE + slot * stride_state_slot + h * D * D + dk[:, None] * D + dv[None, :]
        s = tl.load(s_ptr)
        v = _conv_silu(X, CONV_W, CONV_STATE, n, slot, has, 2 * P + h * D + dv, stride_conv_slot, stride_x, W)
        s, o = _delta_rule(s, has, q, k, decay, beta, v)
        tl.store(s_ptr, s)
        tl.store(O_SCRATCH + head * D + dv, o)
        sumsq += tl.sum(o * o)
    # ---- gated RMSNorm over the head: y = RMSNorm(o; w) * sigmoid(gate) ------------------------
    if PARTS == 1:
        tl.debug_barrier()  # the value blocks' outputs, written by other threads of this program
        _gated_rms_norm(O_SCRATCH, w_gate, Y, n, h, head, sumsq, eps, P, D, False)
    else:
        tl.store(SUMSQ + head * PARTS + part, sumsq)
        if last_arrival(TICKETS, head, PARTS):  # the head's other programs are done: outputs and conv reads
            _conv_shift(pq, sq, W)  # (read before the ticket: this program's own loads)
            _conv_shift(pk, sk, W)
            sumsq = tl.sum(tl.load(SUMSQ + head * PARTS + tl.arange(0, PARTS), cache_modifier=".cg"))
            _gated_rms_norm(O_SCRATCH, w_gate, Y, n, h, head, sumsq, eps, P, D, True)


@triton.jit
def _gated_rms_norm(O_SCRATCH, w_gate, Y, n, h, head, sumsq, eps, P, D: tl.constexpr, FROM_L2: tl.constexpr):
    """y = RMSNorm(o; w) * sigmoid(gate) over the head's output in scratch (FROM_L2: written by
    other programs, so read past this SM's L1); ``w_gate`` = w * sigmoid(gate), loaded early."""
    dk = tl.arange(0, D)
    if FROM_L2:
        o = tl.load(O_SCRATCH + head * D + dk, cache_modifier=".cg")
    else:
        o = tl.load(O_SCRATCH + head * D + dk)
    y = o / tl.sqrt(sumsq / D + eps) * w_gate
    tl.store(Y + n * P + h * D + dk, y.to(Y.dtype.element_ty))


def kda_decode_fused(x_qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, has_ctx: torch.Tensor,
                     f: torch.Tensor, beta_logits: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                     gate: torch.Tensor, o_norm_w: torch.Tensor, eps: float, lower_bound: float | None,
                     state: torch.Tensor, slots: torch.Tensor, num_heads: int, block_v: int = 64,
                     out_dtype: torch.dtype = torch.float32, num_warps: int = 4,
                     parts: int | None = None, gluon: bool | None = None, maxnreg: int | None = None) -> torch.Tensor:
    """The whole KDA token mixer between the input projections and o_proj, for one decode token
    per sequence. x_qkv [N, 3P] pre-conv q|k|v projections; conv_w [3P, W]; conv_state
    [slots, 3P, W-1] and state [slots, H, D, D] (updated in place at ``slots``; rows without
    context start from zeros; ``has_ctx`` [N], bool or int32); f, gate [N, P]; beta_logits [N, H].
    Returns y [N, P] in ``out_dtype``, the gated-RMSNorm output ready for o_proj. ``maxnreg``: a
    register cap a thread (more programs an SM; None: ``HEAD_MAXNREG`` for a program a head). ``parts``:
    programs per head (each D / parts value columns), None: one per value block while heads alone
    would not fill two waves of SMs, else one. ``block_v``, ``num_warps``, ``parts``: the variants
    bench/kernels_kda_decode.py times. (Timed and dropped: prefetching
    the next value block inside one program, TMA state tiles, evict-first loads with streaming
    stores, RESULTS.md seventh and eighth sessions; persistent programs streaming heads through a
    TMA pipeline, value-first [V, K] states, 4-32-row tiles, forty-fourth session; blocks as
    [BV / r, D, r] tiles of r-column runs, fewer registers a thread, 67-73 %, forty-sixth session.) ``gluon``
    (None: ``GLUON_FUSED``): a head's program in ``kda_decode_gluon`` instead, where one program a
    head serves and D = 128."""
    N, P3 = x_qkv.shape
    H = num_heads
    D = P3 // (3 * H)
    W = conv_w.shape[-1]
    if W & (W - 1):
        raise ValueError(f"the fused kernel needs a power-of-two conv width, got {W}")
    if conv_state[0].stride() != (W - 1, 1) or state[0].stride() != (D * D, D, 1):
        raise ValueError("conv state slots must be contiguous [3P, W-1], recurrent slots contiguous [H, D, D]")
    bv = min(block_v, D)
    if parts is None:
        parts = D // bv if N * H < 2 * sm_count(x_qkv.device) else 1
    if parts < 1 or D % (bv * parts):
        raise ValueError(f"{parts} programs a head do not split {D} value columns into blocks of {bv}")
    if maxnreg is None and parts == 1 and num_warps == 4:
        maxnreg = HEAD_MAXNREG
    if (GLUON_FUSED if gluon is None else gluon) and parts == 1 and D == 128 and x_qkv.is_cuda:
        from .kda_decode_gluon import kda_decode_fused_gluon

        return kda_decode_fused_gluon(x_qkv, conv_w, conv_state, has_ctx, f, beta_logits, A_log, dt_bias, gate,
                                      o_norm_w, eps, lower_bound, state, slots, H, out_dtype,
                                      heads_fastest=LAUNCH_ORDER != "sequences")
    o_scratch = torch.empty(N, H, D, dtype=torch.float32, device=x_qkv.device)
    sumsq = torch.empty(N, H, parts, dtype=torch.float32, device=x_qkv.device)
    y = torch.empty(N, H * D, dtype=out_dtype, device=x_qkv.device)
    # Rows may be strided (column slices of one fused projection GEMM): only the last dim must be dense.
    x_qkv, f, beta_logits, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x_qkv, f, beta_logits, gate))
    order = _ORDERS[LAUNCH_ORDER] if N < 65536 else 0  # (a grid's y and z dims stop at 65,535)
    _kda_decode_fused_kernel[((N, H, parts), (H, N, parts), (parts, H, N))[order]](
        x_qkv, conv_w.float().contiguous(), conv_state, has_ctx if has_ctx.dtype == torch.int32 else has_ctx.to(torch.int32),
        f, beta_logits, A_log.float().contiguous(), dt_bias.float().contiguous(),
        gate, o_norm_w.float().contiguous(), state, slots, o_scratch, sumsq, tickets(x_qkv.device, N * H), y,
        conv_state.stride(0), state.stride(0), x_qkv.stride(0), f.stride(0), beta_logits.stride(0), gate.stride(0),
        D ** -0.5, float(lower_bound) if lower_bound is not None else 0.0,
        eps, H, D=D, W=W, BV=bv, BLOCKS=D // (bv * parts), USE_LOWER_BOUND=lower_bound is not None,
        ORDER=order, num_warps=num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
        **pdl.launch(y.device),
    )
    return y


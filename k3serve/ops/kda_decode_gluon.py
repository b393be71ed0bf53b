"""The fused KDA decode mixer (``kda_decode_triton.kda_decode_fused``, one program a head) in Gluon,
so that the head's recurrent state streams in while the program does everything else.

STATUS: checked on the H200 (bench/gpu_check_kernels.py), but **slower** than the Triton kernel:
78 / 84 % of copy at N = 64 / 256 launched heads fastest (75 / 79 % sequences fastest) against
81 / 86 % (RESULTS.md fourteenth and forty-sixth sessions), so opt-in
(``kda_decode_triton.GLUON_FUSED``, ``kda_decode_fused(..., gluon=True)``). A persistent version
(programs over items, the next one or two items' state tiles copied into a shared-memory ring
during this one's prologue; one program an SM) checked correct but ran at 52-56 % (69-74 % with
no look-ahead and three programs an SM): one 4-warp program's serial prologue, barriers and
passes cannot keep an SM's share of the bandwidth busy (RESULTS.md fourteenth session).

Why: the Triton kernel reaches 80 / 83 % of copy at N = 64 / 256 (H = 96, D = 128) against the
bare delta-rule step's 87 / 90 % (RESULTS.md ninth session). Its state tile cannot be loaded
before the v conv's state store (the compiler must assume they alias), and loaded before the q/k
convs it was held in registers across them (3,160 instructions a thread, 43 %). Here the whole
[D, D] fp32 tile (64 KB) is copied into shared memory by cp.async as the program's first act,
the convs, gates and norms run while it is in flight, and the tile is read from shared memory
PASS value columns at a time, updated in registers and stored back to its slot (compiled, 3.6:
128 registers, 1,592 instructions a thread; the Triton kernel 168 and 1,664). (An L2 prefetch of
the state before the convs did not help the Triton kernel, RESULTS.md eleventh session: the bytes
landed in L2, still to be loaded after the prologue; here they land in shared memory.)
Programs: (sequence, head); 64 KB of shared memory each: 3 an SM.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .gluon_compat import async_load, cta_barrier


D_HEAD = 128  # the head width the layouts are written for (K3 and Kimi-Linear)
PASS = 32  # value columns a pass over the tile: 128 registers a thread (64: 184)


@gluon.jit
def _conv_silu(X, CONV_W, CONV_STATE, n, slot, has, ch, stride_conv_slot, stride_x, W: gl.constexpr,
               conv_l: gl.constexpr):
    """Causal depthwise conv of channels ``ch`` [C] over [conv state ; new input], SiLU; the conv
    state shifted by one (each thread reads, then rewrites, its own channels)."""
    wi = gl.arange(0, W, layout=gl.SliceLayout(0, conv_l))
    col = gl.expand_dims(wi, 0) + 0 * gl.expand_dims(ch, 1)
    x_new = gl.load(X + n * stride_x + ch).to(gl.float32)
    cs_ptr = CONV_STATE + slot * stride_conv_slot + gl.expand_dims(ch * (W - 1), 1) + gl.expand_dims(wi, 0)
    old = gl.where(has > 0, gl.load(cs_ptr, mask=col < W - 1, other=0.0).to(gl.float32), 0.0)
    window = gl.where(col == W - 1, gl.expand_dims(x_new, 1), old)  # oldest ... newest
    u = gl.sum(window * gl.load(CONV_W + gl.expand_dims(ch * W, 1) + gl.expand_dims(wi, 0)), 1)
    shifted = gl.where(has > 0, gl.load(cs_ptr + 1, mask=col < W - 2, other=0.0).to(gl.float32), 0.0)
    new_state = gl.where(col == W - 2, gl.expand_dims(x_new, 1), shifted)
    gl.store(cs_ptr, new_state.to(CONV_STATE.dtype.element_ty), mask=col < W - 1)
    return u / (1.0 + gl.exp(-u))


@gluon.jit
def _kda_decode_fused_kernel(
    X, CONV_W, CONV_STATE, HAS_CTX, F, BETA, A_LOG, DT_BIAS, GATE, ONORM_W, STATE, SLOTS, Y,
    stride_conv_slot, stride_state_slot, stride_x, stride_f, stride_b, stride_g, scale, lower_bound, eps, H,
    D: gl.constexpr, W: gl.constexpr, USE_LOWER_BOUND: gl.constexpr, PASS: gl.constexpr,
    HEADS_FASTEST: gl.constexpr = False, NUM_WARPS: gl.constexpr = 4,
):
    """Program (sequence, head), 4 warps (NUM_WARPS: the layouts cover D = 128 channels with them
    exactly, so no thread duplicates another's conv-state read and rewrite): the state tile's copy
    started, the q/k/v convs, gates and L2 norms, then PASS value columns at a time the delta rule
    on the tile read from shared memory (decay, rank-1 update, read-out), the updated columns
    stored to the slot, the outputs to shared memory; last the head's gated RMSNorm."""
    # [key row, value column] pass tile: a warp PASS / 4 columns, a thread 4 consecutive ones
    # (16-byte shared loads, global stores) of every (32 / (PASS / 16))-th row: the reductions
    # over rows stay in the warp (no shared memory, no barrier), and the rows a load touches fall
    # on distinct swizzle phases of the shared tile (4 wavefronts a 512-byte load, the minimum)
    tile_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (PASS // 16), PASS // 16], [1, NUM_WARPS], [1, 0])
    copy_l: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NUM_WARPS, 1], [1, 0])  # 16-byte copies
    conv_l: gl.constexpr = gl.BlockedLayout([1, W], [32, 1], [NUM_WARPS, 1], [1, 0])  # a channel a thread
    vec_l: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
    state_s: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, tile_l)  # key-indexed vectors (q, k, decay)
    cols_l: gl.constexpr = gl.SliceLayout(0, tile_l)  # value-indexed vectors (v, r, o)
    if HEADS_FASTEST:  # grid (H, N): neighbouring programs on neighbouring heads of one slot
        h = gl.program_id(0)
        n = gl.program_id(1)
    else:
        n = gl.program_id(0)
        h = gl.program_id(1)
    P = H * D
    slot = gl.load(SLOTS + n).to(gl.int64)
    base = STATE + slot * stride_state_slot + h * D * D
    # ---- the head's [D, D] fp32 state into shared memory, 16 bytes a thread a copy; a fresh sequence's
    # slot is not read (the masked copies fill zeros: its state starts from zeros) -------------
    has = (gl.load(HAS_CTX + n) != 0).to(gl.float32)
    tile = gl.allocate_shared_memory(gl.float32, [D, D], state_s)
    cr = gl.arange(0, D, layout=gl.SliceLayout(1, copy_l))
    cc = gl.arange(0, D, layout=gl.SliceLayout(0, copy_l))
    live = gl.full([D, D], 1, gl.int1, copy_l) & (has > 0)
    async_load(tile, base + gl.expand_dims(cr * D, 1) + gl.expand_dims(cc, 0), mask=live)  # one copy: no barriers
    async_copy.commit_group()
    # ---- short conv with state for q, k; gates and L2 norms ------------------------------------
    ch = gl.arange(0, D, layout=gl.SliceLayout(1, conv_l))
    q = _conv_silu(X, CONV_W, CONV_STATE, n, slot, has, h * D + ch, stride_conv_slot, stride_x, W, conv_l)
    k = _conv_silu(X, CONV_W, CONV_STATE, n, slot, has, P + h * D + ch, stride_conv_slot, stride_x, W, conv_l)
    q = gl.convert_layout(q / gl.sqrt(gl.sum(q * q, 0) + 1e-6) * scale, rows_l)
    k = gl.convert_layout(k / gl.sqrt(gl.sum(k * k, 0) + 1e-6), rows_l)
    dk = gl.arange(0, D, layout=rows_l)
    f = gl.load(F + n * stride_f + h * D + dk).to(gl.float32) + gl.load(DT_BIAS + h * D + dk)
    a = gl.exp(gl.load(A_LOG + h))
    if USE_LOWER_BOUND:
        g = lower_bound * (1.0 / (1.0 + gl.exp(-a * f)))
    else:
        g = -a * gl.where(f > 20.0, f, gl.log(1.0 + gl.exp(f)))
    decay = gl.exp(g)
    beta = 1.0 / (1.0 + gl.exp(-gl.load(BETA + n * stride_b + h).to(gl.float32)))
    # ---- v's conv (all D channels, so no thread rewrites conv state another still reads) --------
    vec_s: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    v_s = gl.allocate_shared_memory(gl.float32, [D], vec_s)
    v_s.store(_conv_silu(X, CONV_W, CONV_STATE, n, slot, has, 2 * P + h * D + ch, stride_conv_slot, stride_x, W,
                         conv_l))
    # ---- the delta rule, PASS value columns at a time ------------------------------------------
    dkk = gl.expand_dims(decay * k, 1)  # (decay S)^T k = S^T (decay k)
    bk = gl.expand_dims(beta * k, 1)
    dec = gl.expand_dims(decay, 1)
    qq = gl.expand_dims(q, 1)
    o_s = gl.allocate_shared_memory(gl.float32, [D], vec_s)
    async_copy.wait_group(0)
    cta_barrier()  # every thread's copies (and v) have landed
    for j in gl.static_range(D // PASS):
        # S <- decay S + beta k r^T with r = v - (decay S)^T k; o = S^T q; the columns stored back
        dv = j * PASS + gl.arange(0, PASS, layout=cols_l)
        s = tile.slice(j * PASS, PASS, dim=1).load(tile_l)
        r = v_s.slice(j * PASS, PASS).load(cols_l) - gl.sum(s * dkk, 0)
        s = s * dec + bk * gl.expand_dims(r, 0)
        gl.store(base + gl.expand_dims(dk * D, 1) + gl.expand_dims(dv, 0), s)
        o_s.slice(j * PASS, PASS).store(gl.sum(s * qq, 0))
    # ---- gated RMSNorm over the head: y = RMSNorm(o; w) * sigmoid(gate) ------------------------
    cta_barrier()
    o = o_s.load(vec_l)
    dh = gl.arange(0, D, layout=vec_l)
    gt = gl.load(GATE + n * stride_g + h * D + dh).to(gl.float32)
    y = o / gl.sqrt(gl.sum(o * o, 0) / D + eps) * gl.load(ONORM_W + dh) / (1.0 + gl.exp(-gt))
    gl.store(Y + n * P + h * D + dh, y.to(Y.dtype.element_ty))


def kda_decode_fused_gluon(x_qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor,
                           has_ctx: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, A_log: torch.Tensor,
                           dt_bias: torch.Tensor, gate: torch.Tensor, o_norm_w: torch.Tensor, eps: float,
                           lower_bound: float | None, state: torch.Tensor, slots: torch.Tensor, num_heads: int,
                           out_dtype: torch.dtype = torch.float32, pass_cols: int = PASS,
                           heads_fastest: bool = True) -> torch.Tensor:
    """``kda_decode_triton.kda_decode_fused``'s contract with one program a head (its ``parts``
    = 1), for head width ``D_HEAD`` and power-of-two conv widths; the caller has checked the
    slot layouts (contiguous [3P, W-1] conv slots, [H, D, D] fp32 recurrent slots). ``pass_cols``:
    value columns a pass over the tile (32 or 64: whole swizzle rows of the shared tile).
    ``heads_fastest``: grid (H, N) rather than (N, H) (kda_decode_triton's LAUNCH_ORDER; sequences
    fastest past 65,535 of them, the grid's y limit)."""
    N, P3 = x_qkv.shape
    H = num_heads
    D = P3 // (3 * H)
    W = conv_w.shape[-1]
    if D != D_HEAD or W & (W - 1) or state.dtype != torch.float32 or pass_cols not in (32, 64):
        raise ValueError(f"the Gluon KDA decode takes D = {D_HEAD}, a power-of-two conv width, an fp32 state and "
                         f"passes of 32 or 64 columns (got D = {D}, W = {W}, {state.dtype}, {pass_cols})")
    if state.stride(0) % 4 or state.data_ptr() % 16:
        raise ValueError("the Gluon KDA decode copies the state in 16-byte pieces: slots must be 16-byte aligned")
    y = torch.empty(N, H * D, dtype=out_dtype, device=x_qkv.device)
    x_qkv, f, beta_logits, gate = (t if t.stride(-1) == 1 else t.contiguous() for t in (x_qkv, f, beta_logits, gate))
    heads_fastest = heads_fastest and N < 65536
    _kda_decode_fused_kernel[(H, N) if heads_fastest else (N, H)](
        x_qkv, conv_w.float().contiguous(), conv_state,
        has_ctx if has_ctx.dtype == torch.int32 else has_ctx.to(torch.int32), f, beta_logits,
        A_log.float().contiguous(), dt_bias.float().contiguous(), gate, o_norm_w.float().contiguous(), state, slots,
        y, conv_state.stride(0), state.stride(0), x_qkv.stride(0), f.stride(0), beta_logits.stride(0),
        gate.stride(0), D ** -0.5, float(lower_bound) if lower_bound is not None else 0.0, eps, H,
        D=D, W=W, USE_LOWER_BOUND=lower_bound is not None, PASS=pass_cols, HEADS_FASTEST=heads_fastest,
        num_warps=4)
    return y

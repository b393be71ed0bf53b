"""Fused KDA decode step in Triton: gate activation, q/k L2 norms, the delta-rule update and the
output, with the fp32 state read and written in place at each sequence's pool slot.

Decode is bound by the state traffic (8 D^2 bytes per head per token, seed 002), so everything
else rides along in registers: one program per (sequence, head, block of value columns) loads its
[K, BV] state tile once, applies the decay, the rank-1 delta update and the read-out, and writes
the tile back. q, k are the post-conv activations (normalised here), ``f`` the gate
pre-activation without dt_bias, ``b`` the beta logits.

Reference: ``kda_ref.kda_recurrent_ref`` + ``kda_ref.kda_gate``. Checked on CPU under
``TRITON_INTERPRET=1`` (tests/test_kda_decode_triton.py); GPU timing is [gpu-kernels] work.
The short-conv update is not fused yet: q/k conv windows are shared by every value block of a
head, so fusing it needs a write-after-all-reads ordering (a follow-up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_decode_kernel(
    Q, K, V, F, BETA, A_LOG, DT_BIAS, STATE, SLOTS, O,
    stride_state_slot, scale, lower_bound, H,
    D: tl.constexpr, BV: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, D)
    dv = vb * BV + tl.arange(0, BV)
    base = (n * H + h) * D
    q = tl.load(Q + base + dk).to(tl.float32)
    k = tl.load(K + base + dk).to(tl.float32)
    v = tl.load(V + base + dv).to(tl.float32)
    f = tl.load(F + base + dk).to(tl.float32) + tl.load(DT_BIAS + h * D + dk)
    a = tl.exp(tl.load(A_LOG + h))
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * f)
    else:
        g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(f)))
    beta = tl.sigmoid(tl.load(BETA + n * H + h).to(tl.float32))
    q = q / tl.sqrt(tl.sum(q * q) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k) + 1e-6)

    slot = tl.load(SLOTS + n).to(tl.int64)
    s_ptr = STATE + slot * stride_state_slot + h * D * D + dk[:, None] * D + dv[None, :]
    s = tl.load(s_ptr)  # [D, BV] fp32, rows = key channels
    s = s * tl.exp(g)[:, None]
    r = v - tl.sum(s * k[:, None], 0)
    s = s + beta * k[:, None] * r[None, :]
    o = tl.sum(s * q[:, None], 0)
    tl.store(s_ptr, s)
    tl.store(O + base + dv, o)


def kda_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor,
               A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None, scale: float,
               state: torch.Tensor, slots: torch.Tensor, block_v: int = 32) -> torch.Tensor:
    """q, k, v, f: [N, H, D]; beta_logits [N, H]; A_log [H]; dt_bias [H*D]; state [num_slots, H, D, D]
    fp32 (each slot a contiguous [H, D, D] block; the slot stride is free, so pool views work);
    slots [N]. Updates the state in place; returns o [N, H, D] fp32."""
    N, H, D = q.shape
    if state.dtype != torch.float32 or state[0].stride() != (D * D, D, 1):
        raise ValueError("state must be fp32 with contiguous [H, D, D] slots")
    q, k, v, f = (x.contiguous() for x in (q, k, v, f))
    o = torch.empty(N, H, D, dtype=torch.float32, device=q.device)
    bv = min(block_v, D)
    _kda_decode_kernel[(N, H, D // bv)](
        q, k, v, f, beta_logits.contiguous(), A_log.float().contiguous(), dt_bias.float().contiguous(), state,
        slots, o, state.stride(0), scale, float(lower_bound) if lower_bound is not None else 0.0, H,
        D=D, BV=bv, USE_LOWER_BOUND=lower_bound is not None,
    )
    return o

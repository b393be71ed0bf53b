"""MLA prefill through torch's scaled_dot_product_attention (expanded form), a prompt a call.

The library's fused attention where it beats our Triton flash kernel: on the H200 torch's SDPA took
kimi-linear's 8K-token prompt in 1.17 ms against our 1.50 (96 heads: 3.38 against 4.70; its flash
backend refuses 128-wide values under 192-wide keys, so another backend serves: RESULTS.md
thirty-ninth session). On CPU its math backend. A chunk after cached context is causal to its last
key (``causal_lower_right``). Same contract as ``mla_prefill_triton.mla_prefill``; ``model.mla``
takes it where ``PREFILL_SDPA`` is set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .mla_prefill_triton import _expanded


def mla_prefill_sdpa(q: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor, context_len: int, kv_lora_rank: int,
                     nope_dim: int, scale: float) -> torch.Tensor:
    """q [Tq, Ha, dn+dr]; latent [S, rkv+dr] with S = context_len + Tq; w_kv_b [Ha*(dn+dv), rkv].
    Returns o [Tq, Ha, dv] fp32."""
    q, k_nope, k_pe, v = _expanded(q, latent, w_kv_b, kv_lora_rank, nope_dim)
    Tq, Ha, _ = q.shape
    S = latent.shape[0]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, Ha, -1)], dim=-1)
    mask = dict(is_causal=True) if context_len == 0 else dict(attn_mask=causal_lower_right(Tq, S))
    heads_first = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, Ha, T, d]
    o = F.scaled_dot_product_attention(*heads_first, scale=scale, **mask)
    return o[0].transpose(0, 1).float()

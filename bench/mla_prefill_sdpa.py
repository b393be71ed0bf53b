"""MLA prefill through torch's scaled_dot_product_attention (expanded form), a prompt a call: the
library comparator of ``bench.kernels_mla_prefill`` and ``gpu_check_kernels.py --mla-prefill``.

Not served: on the H200 our flash kernel (``ops.mla_prefill_triton``) beat every SDPA backend in every
layout (kimi-linear's 8K-token prompt 1.53 against cuDNN's 1.60 ms, four of 2K 0.55 against 0.93, 2K on
6K of context 0.72 against 1.30; SDPA's flash backend refuses 128-wide values under 192-wide keys), and
kimi-linear-48b's eager 16 x 512 prefill step took 2-3 ms more kernel time with it (RESULTS.md fortieth
session). A chunk after cached context is causal to its last key (``causal_lower_right``). Same
contract as ``mla_prefill_triton.mla_prefill``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from k3serve.ops.mla_prefill_triton import _expanded


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

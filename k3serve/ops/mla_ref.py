"""Plain-torch reference for NoPE MLA attention over the paged latent cache (model-spec §2.4).

Two forms of the same attention, both fp32 inside:
- expanded (prefill): keys/values rebuilt per head from the latent through kv_b_proj;
- absorbed (decode): single-KV-head attention over the 576-wide latent, q absorbed through W_UK
  and the output un-absorbed through W_UV.
"""

from __future__ import annotations

import torch


def gather_latent(latent_pages: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached latents of one sequence: [length, width]."""
    page_size = latent_pages.shape[1]
    n = -(-length // page_size)
    return latent_pages[pages[:n]].reshape(n * page_size, -1)[:length]


def causal_mask(num_queries: int, context_len: int, num_keys: int, device) -> torch.Tensor:
    """True where query t (absolute position context_len + t) may see key s."""
    qpos = context_len + torch.arange(num_queries, device=device)
    return torch.arange(num_keys, device=device)[None, :] <= qpos[:, None]


def mla_expanded_ref(q: torch.Tensor, latent: torch.Tensor, w_kv_b: torch.Tensor, context_len: int,
                     kv_lora_rank: int, nope_dim: int, scale: float) -> torch.Tensor:
    """q [Tq, Ha, dn+dr]; latent [S, rkv+dr] (S = context_len + Tq); w_kv_b [Ha*(dn+dv), rkv].
    Returns o [Tq, Ha, dv] fp32."""
    Tq, Ha, _ = q.shape
    S = latent.shape[0]
    c, k_pe = latent.float().split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    kv = (c @ w_kv_b.float().t()).view(S, Ha, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(S, Ha, -1)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    scores = scores.masked_fill(~causal_mask(Tq, context_len, S, q.device), float("-inf"))
    return torch.einsum("hts,shv->thv", torch.softmax(scores, dim=-1), v)


def absorb_query(q: torch.Tensor, w_kv_b: torch.Tensor, kv_lora_rank: int, nope_dim: int) -> torch.Tensor:
    """q [T, Ha, dn+dr] -> [T, Ha, rkv+dr]: q_nope through W_UK^T, q_pe kept."""
    Ha = q.shape[1]
    w = w_kv_b.float().view(Ha, -1, kv_lora_rank)
    q_abs = torch.einsum("thn,hnc->thc", q[..., :nope_dim].float(), w[:, :nope_dim])
    return torch.cat([q_abs, q[..., nope_dim:].float()], dim=-1)


def unabsorb_output(o_latent: torch.Tensor, w_kv_b: torch.Tensor, kv_lora_rank: int, nope_dim: int) -> torch.Tensor:
    """o_latent [T, Ha, rkv] -> [T, Ha, dv] through W_UV."""
    Ha = o_latent.shape[1]
    w = w_kv_b.float().view(Ha, -1, kv_lora_rank)
    return torch.einsum("thc,hvc->thv", o_latent, w[:, nope_dim:])


def mla_absorbed_ref(q_abs: torch.Tensor, latent: torch.Tensor, key_mask: torch.Tensor,
                     kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Batched absorbed attention. q_abs [B, Tq, Ha, rkv+dr]; latent [B, S, rkv+dr];
    key_mask [B, Tq, S] (True = visible). Returns the latent-space output [B, Tq, Ha, rkv] fp32."""
    lat = latent.float()
    scores = torch.einsum("bthc,bsc->bhts", q_abs, lat) * scale
    scores = scores.masked_fill(~key_mask[:, None], float("-inf"))
    return torch.einsum("bhts,bsc->bthc", torch.softmax(scores, dim=-1), lat[..., :kv_lora_rank])

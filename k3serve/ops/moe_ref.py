"""Plain-torch reference for the router and the routed experts (model-spec §2.5)."""

from __future__ import annotations

from typing import Callable

import torch

from ..model.layers import glu_activation


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_groups: int, topk_group: int,
          renormalize: bool, scaling: float, score_func: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-corrected grouped top-k. logits [T, E] fp32. Selection uses scores + bias; the
    weights use the unbiased scores, renormalised before the scaling factor.
    Returns (weights [T, K] fp32, expert ids [T, K] int64)."""
    T, E = logits.shape
    scores = torch.sigmoid(logits.float()) if score_func == "sigmoid" else torch.softmax(logits.float(), dim=-1)
    choice = scores + bias.float() if bias is not None else scores
    if num_groups > 1:
        grouped = choice.view(T, num_groups, E // num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scaling, ids


def experts_ref(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                act: str, beta: float = 1.0, linear_beta: float | None = None) -> torch.Tensor:
    """sum_i w_i * W2_e glu(W1_e x, W3_e x), accumulated in fp32. ``expert_weights(e)`` returns
    (w1 [I, din], w2 [dout, I], w3 [I, din]) in compute dtype (MXFP4 dequantised on use).
    Loops over the experts that received tokens, not over tokens."""
    T = x.shape[0]
    out = None
    flat_ids = ids.flatten()
    order = flat_ids.argsort(stable=True)
    counts = torch.bincount(flat_ids, minlength=1).tolist()
    token_of = order // ids.shape[1]
    w_sorted = weights.flatten()[order]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        tok = token_of[start:start + n]
        w1, w2, w3 = expert_weights(e)
        xe = x[tok].to(w1.dtype)
        h = glu_activation(xe @ w1.t(), xe @ w3.t(), act, beta, linear_beta)
        y = (h @ w2.t()).float() * w_sorted[start:start + n, None]
        if out is None:
            out = torch.zeros(T, y.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tok, y)
        start += n
    return out

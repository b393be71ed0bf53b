"""Plain-torch reference for Kimi Delta Attention (model-spec §2.3, seed 002).

Two forms of the same recurrence, both fp32, state in fla's [H, K, V] layout:
- ``kda_recurrent_ref``: the per-token delta rule, the definition everything is tested against;
- ``kda_chunked_ref``: the chunked UT-transform (FlashKDA) algorithm used for prefill.
The chunked form never forms exp(G_i) * exp(-G_j) separately: every intra-chunk decay is an
exp of a per-pair difference G_i - G_j <= 0, so the K3 bound (g down to -5 per token) cannot
overflow however long the chunk is (model-spec §5 pitfall 6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps): eps inside the sqrt, as fla and the references do."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None
) -> torch.Tensor:
    """Per-channel log decay g from the low-rank pre-activation f ([..., H, D], without dt_bias).

    lower_bound None: Kimi-Linear's g = -exp(A_log) * softplus(f + dt_bias).
    lower_bound λ:    K3's g = λ * sigmoid(exp(A_log) * (f + dt_bias)), in (λ, 0).
    """
    H, D = f.shape[-2:]
    z = f.float() + dt_bias.float().view(H, D)
    a = torch.exp(A_log.float()).view(H, 1)
    if lower_bound is None:
        return -a * torch.where(z > 20.0, z, torch.log1p(torch.exp(z)))
    return lower_bound * torch.sigmoid(a * z)


def kda_recurrent_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token recurrence. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H];
    state [B, H, K, V]. q, k must already be L2-normalised; q is multiplied by ``scale`` here.
    Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = torch.zeros(B, H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        S = S + initial_state.float()
    out = q.new_empty(B, T, H, V)
    for t in range(T):
        S = S * torch.exp(g[:, t]).unsqueeze(-1)  # S <- Diag(alpha) S
        r = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * k[:, t].unsqueeze(-1) * r.unsqueeze(-2)
        out[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t] * scale)
    return out, S


# The factorised pairwise decay is used while every factor exp(+-(G - G_mid)) of the chunk stays
# below exp(80), well inside fp32's normal range (about exp(+-87)).
FACTORISED_MAX_EXPONENT = 80.0


def _pairwise(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, factorised: bool) -> torch.Tensor:
    """sum_c a_i[c] b_j[c] exp(G_i[c] - G_j[c]) for one chunk ([H, C, K] each) where j <= i, 0 above.

    Factorised around the chunk's middle position it is one matmul; otherwise (very strong decay,
    e.g. an unbounded softplus gate) the exact [H, C, C, K] pairwise form. The factorised product
    may overflow above the diagonal: it is masked here, before anything multiplies it (a later
    0 * inf would turn the backward pass into NaN)."""
    C = G.shape[1]
    incl = torch.tril(torch.ones(C, C, dtype=torch.bool, device=G.device))
    if factorised:
        mid = G[:, C // 2: C // 2 + 1]
        return ((a * torch.exp(G - mid)) @ (b * torch.exp(mid - G)).transpose(1, 2)).masked_fill(~incl, 0.0)
    diff = (G.unsqueeze(2) - G.unsqueeze(1)).masked_fill(~incl[None, :, :, None], float("-inf"))
    return torch.einsum("hik,hjk,hijk->hij", a, b, torch.exp(diff))


def kda_chunked_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked UT-transform form for one sequence. q, k, g: [T, H, K]; v: [T, H, V];
    beta: [T, H]; state [H, K, V]. Same contract as ``kda_recurrent_ref`` without the batch dim.

    Per chunk (seed 002, FlashKDA K1/K2), with G the inclusive cumulative log decay:
        L   = StrictTril(beta_i * sum_c k_i k_j exp(G_i - G_j))      (UT transform)
        U   = (I + L)^-1 diag(beta) (V - (exp(G) * K) S)
        O   = (exp(G) * Q) S + Tril(sum_c q_i k_j exp(G_i - G_j)) U
        S'  = exp(G_last) * S + (exp(G_last - G) * K)^T U
    Everything but the state recurrence is computed for all chunks at once.
    """
    T, H, K = k.shape
    V = v.shape[-1]
    C = chunk_size
    pad = (-T) % C
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    # Padding tokens have k = 0, beta = 0, g = 0: they neither decay nor write the state.
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C
    # [n, H, C, D] chunk-major, head-batched
    q, k, v, g = (x.view(n, C, H, -1).transpose(1, 2) for x in (q, k, v, g))
    beta = beta.view(n, C, H).transpose(1, 2)
    q = q * scale
    G = g.cumsum(2)  # [n, H, C, K]
    mid = G[:, :, C // 2]  # G decreases along the chunk, so the ends are furthest from the middle
    safe = (torch.maximum(G[:, :, 0] - mid, mid - G[:, :, -1]).amax(dim=(1, 2)) <= FACTORISED_MAX_EXPONENT).tolist()
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool, device=q.device), diagonal=-1)
    kk = torch.stack([_pairwise(k[c], k[c], G[c], safe[c]) for c in range(n)])
    qk = torch.stack([_pairwise(q[c], k[c], G[c], safe[c]) for c in range(n)])
    L = (beta.unsqueeze(-1) * kk).masked_fill(~strict, 0.0)
    Mqk = qk
    eye = torch.eye(C, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False, unitriangular=True)
    a = torch.exp(G)
    k_restore = torch.exp(G[:, :, -1:] - G) * k
    S = torch.zeros(H, K, V, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        S = S + initial_state.float()
    outs = []
    for c in range(n):
        U = Tinv[c] @ (beta[c].unsqueeze(-1) * (v[c] - (a[c] * k[c]) @ S))
        outs.append((a[c] * q[c]) @ S + Mqk[c] @ U)
        S = a[c, :, -1, :].unsqueeze(-1) * S + k_restore[c].transpose(1, 2) @ U
    o = torch.stack(outs).transpose(1, 2).reshape(n * C, H, V)[:T]
    return o, S

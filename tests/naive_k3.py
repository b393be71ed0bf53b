"""Independent, naive float64 reference of the Kimi K3 / Kimi-Linear text model.

Written only from docs/model-spec.md (sections 2.1-2.8, 3.1-3.3, 5); it imports nothing from
k3serve. Everything is float64, per-token Python loops, clarity over speed. Not a pytest module
(no test_ prefix); tests import the functions below.

Main entry point:
    naive_forward(tensors, cfg, token_ids) -> logits [T, V] float64

Helpers exported for individual tests:
    naive_rmsnorm, naive_situ_glu, naive_silu_glu, naive_attn_res_mix, naive_router,
    naive_dequant_mxfp4, naive_kda_gate, naive_kda_layer, naive_mla_layer, naive_moe
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64

# E2M1 magnitude codes 0..7 (spec §3.3).
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --------------------------------------------------------------------------------------------
# small building blocks
# --------------------------------------------------------------------------------------------


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(F64)


def naive_rmsnorm(x: torch.Tensor, gamma: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim: gamma * x / sqrt(mean(x^2) + eps)."""
    x = _f64(x)
    y = x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps)
    if gamma is not None:
        y = y * _f64(gamma)
    return y


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * _sigmoid(x)


def _softplus(z: torch.Tensor) -> torch.Tensor:
    # softplus(z) = z if z > 20 else log(1 + e^z)
    return torch.where(z > 20, z, torch.log1p(torch.exp(torch.clamp(z, max=20.0))))


def naive_silu_glu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = _f64(a), _f64(b)
    return a * _sigmoid(a) * b


def naive_situ_glu(a: torch.Tensor, b: torch.Tensor, beta, beta_lin) -> torch.Tensor:
    """SiTU-GLU: [beta*tanh(a/beta)*sigmoid(a)] * [beta_lin*tanh(b/beta_lin)].

    beta None -> 1.0; beta_lin None -> b unclipped. The sigmoid sees the unclipped a.
    """
    a, b = _f64(a), _f64(b)
    if beta is None:
        beta = 1.0
    beta = float(beta)
    left = beta * torch.tanh(a / beta) * _sigmoid(a)
    if beta_lin is None:
        right = b
    else:
        beta_lin = float(beta_lin)
        right = beta_lin * torch.tanh(b / beta_lin)
    return left * right


def _glu_act(cfg: dict):
    act = cfg.get("hidden_act", "silu")
    if act == "situ":
        beta = cfg.get("activation_situ_beta")
        beta_lin = cfg.get("activation_situ_linear_beta")
        return lambda a, b: naive_situ_glu(a, b, beta, beta_lin)
    if act == "silu":
        return naive_silu_glu
    raise ValueError(f"unsupported hidden_act {act!r}")


def naive_dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 (compressed-tensors mxfp4-pack-quantized) -> float64 [N, Kin].

    packed [N, Kin/2] uint8: low nibble = element 2j, high nibble = element 2j+1.
    scale [N, Kin/32] uint8 E8M0: 2^(byte-127), one per 32 consecutive inputs of a row.
    """
    packed = packed.to(torch.int64)
    scale = scale.to(torch.int64)
    n_rows, half = packed.shape
    kin = 2 * half
    assert scale.shape == (n_rows, kin // 32), (tuple(scale.shape), n_rows, kin)
    if bool((scale == 255).any()):
        raise ValueError("E8M0 scale byte 255 (NaN) is invalid")
    lo = packed & 0xF
    hi = (packed >> 4) & 0xF
    codes = torch.empty(n_rows, kin, dtype=torch.int64)
    codes[:, 0::2] = lo
    codes[:, 1::2] = hi
    table = torch.tensor(_E2M1, dtype=F64)
    mag = table[codes & 0x7]
    val = torch.where((codes & 0x8) != 0, -mag, mag)
    # exact powers of two in float64 (2^-127 .. 2^127 all representable)
    s = torch.tensor(
        [[math.ldexp(1.0, int(b) - 127) for b in row] for row in scale.tolist()], dtype=F64
    ).reshape(n_rows, kin // 32)
    s_full = s.repeat_interleave(32, dim=1)
    return val * s_full


def naive_kda_gate(f, A_log, dt_bias, lower_bound, num_heads: int | None = None):
    """KDA forget gate g = log(alpha), returned as [..., H, Dk] float64.

    f: the pre-activation W_fb(W_fa x) WITHOUT dt_bias, shape [..., H, Dk] or [..., P].
    dt_bias: [P] (added here). A_log: [H], [1,1,H,1] or a longer 1-D vector of which the first
    H entries are used. H is taken from f when f is [..., H, Dk]; for a flat f it is num_heads
    if given, else the number of entries of A_log.
    Bounded form (lower_bound not None, K3): g = lower_bound * sigmoid(a_h * (f + dt_bias));
    otherwise g = -a_h * softplus(f + dt_bias), with a_h = exp(A_log[h]). alpha = exp(g).
    """
    f = _f64(f)
    dt_bias = _f64(dt_bias).reshape(-1)
    a_flat = _f64(A_log).reshape(-1)
    P = dt_bias.numel()
    if f.shape[-1] == P:
        H = int(num_heads) if num_heads is not None else a_flat.numel()
        f_flat = f
    else:
        H = f.shape[-2]
        assert f.shape[-2] * f.shape[-1] == P, (tuple(f.shape), P)
        f_flat = f.reshape(*f.shape[:-2], P)
    return _kda_gate_h(f_flat + dt_bias, a_flat, lower_bound, H)


def _kda_gate_h(f_plus_bias: torch.Tensor, a_flat: torch.Tensor, lower_bound, H: int):
    P = f_plus_bias.shape[-1]
    assert P % H == 0 and a_flat.numel() >= H, (P, H, a_flat.numel())
    Dk = P // H
    fh = f_plus_bias.reshape(*f_plus_bias.shape[:-1], H, Dk)
    a = torch.exp(a_flat[:H]).reshape(H, 1)
    if lower_bound is not None:
        return float(lower_bound) * _sigmoid(a * fh)
    return -a * _softplus(fh)


def naive_attn_res_mix(sources: list[torch.Tensor], w: torch.Tensor, gamma: torch.Tensor, eps: float):
    """AttnRes Mix: sum_i softmax_i(w . RMSNorm(v_i; gamma, eps)) v_i.

    sources: list of tensors [..., d] (same shape); w: [1, d] or [d]; gamma: [d].
    """
    w = _f64(w).reshape(-1)
    vs = [_f64(v) for v in sources]
    scores = torch.stack([(naive_rmsnorm(v, gamma, eps) * w).sum(-1) for v in vs], dim=0)  # [m, ...]
    alpha = torch.softmax(scores, dim=0)
    out = torch.zeros_like(vs[0])
    for i, v in enumerate(vs):
        out = out + alpha[i].unsqueeze(-1) * v
    return out


def _cfg_get(cfg: dict, *names, default=None):
    for n in names:
        if n in cfg and cfg[n] is not None:
            return cfg[n]
    return default


def naive_router(x: torch.Tensor, W_r: torch.Tensor, bias: torch.Tensor | None, cfg: dict):
    """Router for one token x [d] (or [T, d]). Returns (weights [.., K] f64, ids [.., K] int64)."""
    x = _f64(x)
    if x.dim() == 2:
        res = [naive_router(x[t], W_r, bias, cfg) for t in range(x.shape[0])]
        return torch.stack([r[0] for r in res]), torch.stack([r[1] for r in res])
    W_r = _f64(W_r)
    E = W_r.shape[0]
    K = int(_cfg_get(cfg, "num_experts_per_token", "num_experts_per_tok"))
    z = W_r @ x
    func = cfg.get("moe_router_activation_func") or "sigmoid"
    if func == "sigmoid":
        s = _sigmoid(z)
    elif func == "softmax":
        s = torch.softmax(z, dim=-1)
    else:
        raise ValueError(func)
    c = s + (_f64(bias) if bias is not None else 0.0)
    use_grouped = cfg.get("use_grouped_topk", True)
    G = int(_cfg_get(cfg, "num_expert_group", "n_group", default=1))
    topk_group = int(_cfg_get(cfg, "topk_group", default=G))
    allowed = [True] * E
    if use_grouped and G > 1:
        per = E // G
        group_scores = []
        for g in range(G):
            vals = sorted(c[g * per:(g + 1) * per].tolist(), reverse=True)
            group_scores.append(sum(vals[:2]))
        kept = sorted(range(G), key=lambda g: group_scores[g], reverse=True)[:topk_group]
        allowed = [(e // per) in kept for e in range(E)]
    cand = [e for e in range(E) if allowed[e]]
    chosen = sorted(cand, key=lambda e: float(c[e]), reverse=True)[:K]
    ids = torch.tensor(chosen, dtype=torch.int64)
    wts = s[ids].clone()
    if cfg.get("moe_renormalize", _cfg_get(cfg, "norm_topk_prob", default=True)):
        wts = wts / (wts.sum() + 1e-20)
    wts = wts * float(_cfg_get(cfg, "routed_scaling_factor", default=1.0))
    return wts, ids


# --------------------------------------------------------------------------------------------
# tensor access
# --------------------------------------------------------------------------------------------


class _Weights:
    """Name lookup with the K3 prefix; falls back to Kimi-Linear / legacy names."""

    def __init__(self, tensors: dict):
        self.t = tensors

    def _find(self, name: str):
        # name is relative: "model.xxx" or "lm_head.weight"
        cands = ["language_model." + name, name]
        if name.startswith("model.layers."):
            cands.append("language_model." + name[len("model."):])
        for c in cands:
            if c in self.t:
                return c
        return None

    def has(self, name: str) -> bool:
        return self._find(name) is not None

    def __call__(self, name: str) -> torch.Tensor:
        k = self._find(name)
        if k is None:
            raise KeyError(f"missing tensor language_model.{name}")
        return _f64(self.t[k])

    def raw(self, name: str) -> torch.Tensor:
        k = self._find(name)
        if k is None:
            raise KeyError(f"missing tensor language_model.{name}")
        return self.t[k]


# --------------------------------------------------------------------------------------------
# token mixers
# --------------------------------------------------------------------------------------------


def naive_kda_layer(Wt: _Weights, pre: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """KDA token mixer over a full sequence. x [T, d] (normalized sublayer input) -> [T, d]."""
    lac = cfg["linear_attn_config"]
    H = int(lac["num_heads"])
    Dk = int(lac["head_dim"])
    W = int(lac["short_conv_kernel_size"])
    P = H * Dk
    eps = float(cfg["rms_norm_eps"])
    lower_bound = lac.get("gate_lower_bound")
    T = x.shape[0]

    # 1. projections
    zq = x @ Wt(pre + "q_proj.weight").T
    zk = x @ Wt(pre + "k_proj.weight").T
    zv = x @ Wt(pre + "v_proj.weight").T

    # 2. causal depthwise conv (zero history) + SiLU
    def conv(z, wname):
        w = Wt(pre + wname).reshape(P, W)
        u = torch.zeros(T, P, dtype=F64)
        for t in range(T):
            for j in range(W):
                src = t - W + 1 + j
                if src >= 0:
                    u[t] += w[:, j] * z[src]
        return _silu(u)

    q = conv(zq, "q_conv1d.weight")
    k = conv(zk, "k_conv1d.weight")
    v = conv(zv, "v_conv1d.weight")

    # 3. heads
    q = q.reshape(T, H, Dk)
    k = k.reshape(T, H, Dk)
    v = v.reshape(T, H, Dk)

    # 4. L2 norm (eps inside sqrt) and q scale
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (Dk ** -0.5)

    # 5. forget gate from the layer input x
    f = (x @ Wt(pre + "f_a_proj.weight").T) @ Wt(pre + "f_b_proj.weight").T  # [T, P]
    f = f + Wt(pre + "dt_bias").reshape(P)
    g = _kda_gate_h(f, Wt(pre + "A_log").reshape(-1), lower_bound, H)  # [T, H, Dk]
    alpha = torch.exp(g)

    # 6. beta
    beta = _sigmoid(x @ Wt(pre + "b_proj.weight").T)  # [T, H]

    # 7. delta rule, state S [H, K, V]
    S = torch.zeros(H, Dk, Dk, dtype=F64)
    o = torch.zeros(T, H, Dk, dtype=F64)
    for t in range(T):
        for h in range(H):
            Sh = alpha[t, h].unsqueeze(1) * S[h]  # row i scaled by alpha[i]
            r = v[t, h] - Sh.T @ k[t, h]
            Sh = Sh + beta[t, h] * torch.outer(k[t, h], r)
            S[h] = Sh
            o[t, h] = Sh.T @ q[t, h]

    # 8. output gate
    if lac.get("use_full_rank_gate"):
        gate = x @ Wt(pre + "g_proj.weight").T
    else:
        gate = (x @ Wt(pre + "g_a_proj.weight").T) @ Wt(pre + "g_b_proj.weight").T
    gate = gate.reshape(T, H, Dk)

    # 9. gated RMSNorm per head
    y = naive_rmsnorm(o, Wt(pre + "o_norm.weight").reshape(Dk), eps) * _sigmoid(gate)

    # 10. o_proj
    return y.reshape(T, P) @ Wt(pre + "o_proj.weight").T


def naive_mla_layer(Wt: _Weights, pre: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """MLA (NoPE) token mixer, expanded form, causal. x [T, d] -> [T, d]."""
    Ha = int(cfg["num_attention_heads"])
    dn = int(cfg["qk_nope_head_dim"])
    dr = int(cfg["qk_rope_head_dim"])
    dv = int(cfg["v_head_dim"])
    rkv = int(cfg["kv_lora_rank"])
    dqk = dn + dr
    eps = float(cfg["rms_norm_eps"])
    T = x.shape[0]

    if cfg.get("q_lora_rank") is not None:
        cq = naive_rmsnorm(x @ Wt(pre + "q_a_proj.weight").T, Wt(pre + "q_a_layernorm.weight"), eps)
        q = cq @ Wt(pre + "q_b_proj.weight").T
    else:
        q = x @ Wt(pre + "q_proj.weight").T
    q = q.reshape(T, Ha, dqk)

    a = x @ Wt(pre + "kv_a_proj_with_mqa.weight").T  # [T, rkv + dr]
    c = naive_rmsnorm(a[:, :rkv], Wt(pre + "kv_a_layernorm.weight"), eps)
    k_pe = a[:, rkv:]  # [T, dr], shared by all heads, not rotated
    Wkvb = Wt(pre + "kv_b_proj.weight").reshape(Ha, dn + dv, rkv)

    scale = 1.0 / math.sqrt(dqk)
    o = torch.zeros(T, Ha, dv, dtype=F64)
    for h in range(Ha):
        W_UK = Wkvb[h, :dn]  # [dn, rkv]
        W_UV = Wkvb[h, dn:]  # [dv, rkv]
        keys = torch.cat([c @ W_UK.T, k_pe], dim=-1)  # [T, dqk]
        vals = c @ W_UV.T  # [T, dv]
        for t in range(T):
            scores = torch.stack([(q[t, h] * keys[s]).sum() * scale for s in range(t + 1)])
            p = torch.softmax(scores, dim=0)
            acc = torch.zeros(dv, dtype=F64)
            for s in range(t + 1):
                acc = acc + p[s] * vals[s]
            o[t, h] = acc
    o = o.reshape(T, Ha * dv)
    if cfg.get("mla_use_output_gate"):
        o = o * _sigmoid(x @ Wt(pre + "g_proj.weight").T)
    return o @ Wt(pre + "o_proj.weight").T


# --------------------------------------------------------------------------------------------
# channel mixers
# --------------------------------------------------------------------------------------------


def _mlp(Wt: _Weights, pre: str, act, x: torch.Tensor) -> torch.Tensor:
    a = x @ Wt(pre + "gate_proj.weight").T
    b = x @ Wt(pre + "up_proj.weight").T
    return act(a, b) @ Wt(pre + "down_proj.weight").T


def _expert_matrix(Wt: _Weights, name: str) -> torch.Tensor:
    """name like '...experts.3.w1' -> dequantized/upcast float64 [out, in]."""
    if Wt.has(name + ".weight_packed"):
        return naive_dequant_mxfp4(Wt.raw(name + ".weight_packed"), Wt.raw(name + ".weight_scale"))
    return Wt(name + ".weight")


def naive_moe(Wt: _Weights, pre: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """MoE channel mixer (full-width or latent, §2.5/§2.6). x [T, d] -> [T, d]."""
    act = _glu_act(cfg)
    eps = float(cfg["rms_norm_eps"])
    T = x.shape[0]
    W_r = Wt(pre + "gate.weight")
    bias = Wt(pre + "gate.e_score_correction_bias") if Wt.has(pre + "gate.e_score_correction_bias") else None
    latent = cfg.get("routed_expert_hidden_size") is not None

    cache: dict[int, tuple] = {}

    def expert(e):
        if e not in cache:
            base = f"{pre}experts.{e}."
            cache[e] = (
                _expert_matrix(Wt, base + "w1"),
                _expert_matrix(Wt, base + "w2"),
                _expert_matrix(Wt, base + "w3"),
            )
        return cache[e]

    out = torch.zeros_like(x)
    for t in range(T):
        xt = x[t]
        wts, ids = naive_router(xt, W_r, bias, cfg)
        inp = Wt(pre + "routed_expert_down_proj.weight") @ xt if latent else xt
        r = torch.zeros_like(inp)
        for w_i, e in zip(wts.tolist(), ids.tolist()):
            w1, w2, w3 = expert(e)
            h = act(w1 @ inp, w3 @ inp)
            r = r + w_i * (w2 @ h)
        if latent:
            if cfg.get("latent_moe_use_norm"):
                r = naive_rmsnorm(r, Wt(pre + "routed_expert_norm.weight"), eps)
            r = Wt(pre + "routed_expert_up_proj.weight") @ r
        out[t] = r
    if int(_cfg_get(cfg, "num_shared_experts", "n_shared_experts", default=0)) > 0:
        out = out + _mlp(Wt, pre + "shared_experts.", act, x)
    return out


def _is_moe_layer(cfg: dict, l: int) -> bool:
    if cfg.get("num_experts") is None:
        return False
    fkd = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    return l >= fkd and l % freq == 0


def _is_kda_layer(cfg: dict, l: int) -> bool:
    lac = cfg.get("linear_attn_config")
    if not lac:
        return False
    return (l + 1) in [int(i) for i in lac["kda_layers"]]


# --------------------------------------------------------------------------------------------
# full model
# --------------------------------------------------------------------------------------------


def naive_forward(tensors: dict[str, torch.Tensor], cfg: dict, token_ids: list[int]) -> torch.Tensor:
    """Full-sequence forward (one sequence, fresh state) of the K3 text model; returns logits [T, V] float64."""
    Wt = _Weights(tensors)
    L = int(cfg["num_hidden_layers"])
    eps = float(cfg["rms_norm_eps"])
    act = _glu_act(cfg)
    B = cfg.get("attn_res_block_size")

    emb = Wt("model.embed_tokens.weight")
    ids = torch.tensor(list(token_ids), dtype=torch.int64)
    e = emb[ids]  # [T, d]

    def token_mixer(l, xin):
        pre = f"model.layers.{l}.self_attn."
        if _is_kda_layer(cfg, l):
            return naive_kda_layer(Wt, pre, cfg, xin)
        return naive_mla_layer(Wt, pre, cfg, xin)

    def channel_mixer(l, xin):
        if _is_moe_layer(cfg, l):
            return naive_moe(Wt, f"model.layers.{l}.block_sparse_moe.", cfg, xin)
        return _mlp(Wt, f"model.layers.{l}.mlp.", act, xin)

    def lw(l, name):
        return Wt(f"model.layers.{l}.{name}")

    if B is None:
        # plain pre-norm residual stream (§2.2)
        h = e.clone()
        for l in range(L):
            a = token_mixer(l, naive_rmsnorm(h, lw(l, "input_layernorm.weight"), eps))
            h = h + a
            m = channel_mixer(l, naive_rmsnorm(h, lw(l, "post_attention_layernorm.weight"), eps))
            h = h + m
        h_final = h
    else:
        # Block Attention Residuals from the definition (§2.7)
        B = int(B)
        blocks = [e]  # b_0 = e, b_n = sum of u over layers (n-1)B .. nB-1
        u = []  # u_l = a_l + m_l
        for l in range(L):
            n = l // B
            # completed blocks b_1..b_n (block n ends at layer nB-1 < l)
            while len(blocks) < n + 1:
                j = len(blocks)  # build b_j
                s = torch.zeros_like(e)
                for ll in range((j - 1) * B, j * B):
                    s = s + u[ll]
                blocks.append(s)
            assert len(blocks) == n + 1
            # partial p = sum_{j=nB}^{l-1} u_j (non-empty iff l mod B != 0)
            if l % B != 0:
                p = torch.zeros_like(e)
                for ll in range(n * B, l):
                    p = p + u[ll]
                src = blocks[: n + 1] + [p]
            else:
                p = torch.zeros_like(e)
                src = blocks[: n + 1]
            mix = naive_attn_res_mix(
                src, lw(l, "self_attention_res_proj.weight"), lw(l, "self_attention_res_norm.weight"), eps
            )
            a = token_mixer(l, naive_rmsnorm(mix, lw(l, "input_layernorm.weight"), eps))
            src2 = blocks[: n + 1] + [p + a]
            mix2 = naive_attn_res_mix(src2, lw(l, "mlp_res_proj.weight"), lw(l, "mlp_res_norm.weight"), eps)
            m = channel_mixer(l, naive_rmsnorm(mix2, lw(l, "post_attention_layernorm.weight"), eps))
            u.append(a + m)
        N = -(-L // B)
        while len(blocks) < N:
            j = len(blocks)
            s = torch.zeros_like(e)
            for ll in range((j - 1) * B, j * B):
                s = s + u[ll]
            blocks.append(s)
        last = torch.zeros_like(e)
        for ll in range((N - 1) * B, L):
            last = last + u[ll]
        src = blocks[:N] + [last]
        h_final = naive_attn_res_mix(
            src, Wt("model.output_attn_res_proj.weight"), Wt("model.output_attn_res_norm.weight"), eps
        )

    hn = naive_rmsnorm(h_final, Wt("model.norm.weight"), eps)
    return hn @ Wt("lm_head.weight").T


# --------------------------------------------------------------------------------------------
# sanity check
# --------------------------------------------------------------------------------------------


def _random_k3_tiny(seed: int = 0):
    """A tiny K3-shaped config and random checkpoint dict (MXFP4 experts)."""
    g = torch.Generator().manual_seed(seed)
    d, V, L = 32, 64, 4
    H, Dk, W = 2, 8, 4
    P = H * Dk
    Ha, dn, dr, dv, rq, rkv = 2, 8, 4, 8, 16, 12
    E, K, I, Ns, dl = 4, 2, 64, 1, 32
    Id = 48
    cfg = {
        "hidden_size": d, "vocab_size": V, "num_hidden_layers": L, "intermediate_size": Id,
        "linear_attn_config": {
            "kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": H, "head_dim": Dk,
            "short_conv_kernel_size": W, "use_full_rank_gate": True, "gate_lower_bound": -5.0,
        },
        "q_lora_rank": rq, "kv_lora_rank": rkv, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr,
        "v_head_dim": dv, "mla_use_output_gate": True, "mla_use_nope": True, "num_attention_heads": Ha,
        "hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "num_experts": E, "num_experts_per_token": K, "moe_intermediate_size": I,
        "num_shared_experts": Ns, "routed_scaling_factor": 1.0, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
        "num_expert_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1,
        "routed_expert_hidden_size": dl, "latent_moe_use_norm": True, "attn_res_block_size": 2,
        "rms_norm_eps": 1e-5,
    }

    def rn(*shape, s=None):
        fan_in = shape[-1]
        s = s if s is not None else fan_in ** -0.5
        return (torch.randn(*shape, generator=g) * s).to(torch.bfloat16)

    def ones_ish(n):
        return (1.0 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16)

    pre = "language_model.model."
    t = {
        pre + "embed_tokens.weight": rn(V, d, s=1.0),
        pre + "norm.weight": ones_ish(d),
        "language_model.lm_head.weight": rn(V, d),
        pre + "output_attn_res_norm.weight": ones_ish(d),
        pre + "output_attn_res_proj.weight": rn(1, d, s=0.3),
    }
    for l in range(L):
        lp = f"{pre}layers.{l}."
        for nm in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[lp + nm + ".weight"] = ones_ish(d)
        t[lp + "self_attention_res_proj.weight"] = rn(1, d, s=0.3)
        t[lp + "mlp_res_proj.weight"] = rn(1, d, s=0.3)
        a = lp + "self_attn."
        if (l + 1) in cfg["linear_attn_config"]["kda_layers"]:
            for nm in ("q", "k", "v"):
                t[a + f"{nm}_proj.weight"] = rn(P, d)
                t[a + f"{nm}_conv1d.weight"] = torch.randn(P, 1, W, generator=g) * 0.5
            t[a + "f_a_proj.weight"] = rn(Dk, d)
            t[a + "f_b_proj.weight"] = rn(P, Dk)
            t[a + "dt_bias"] = torch.randn(P, generator=g) * 0.5
            t[a + "A_log"] = torch.randn(H + 3, generator=g) * 0.5  # stored longer than H
            t[a + "b_proj.weight"] = rn(H, d)
            t[a + "g_proj.weight"] = rn(P, d)
            t[a + "o_norm.weight"] = 1.0 + 0.1 * torch.randn(Dk, generator=g)
            t[a + "o_proj.weight"] = rn(d, P)
        else:
            t[a + "q_a_proj.weight"] = rn(rq, d)
            t[a + "q_a_layernorm.weight"] = ones_ish(rq)
            t[a + "q_b_proj.weight"] = rn(Ha * (dn + dr), rq)
            t[a + "kv_a_proj_with_mqa.weight"] = rn(rkv + dr, d)
            t[a + "kv_a_layernorm.weight"] = ones_ish(rkv)
            t[a + "kv_b_proj.weight"] = rn(Ha * (dn + dv), rkv)
            t[a + "g_proj.weight"] = rn(Ha * dv, d)
            t[a + "o_proj.weight"] = rn(d, Ha * dv)
        if l < cfg["first_k_dense_replace"]:
            m = lp + "mlp."
            t[m + "gate_proj.weight"] = rn(Id, d)
            t[m + "up_proj.weight"] = rn(Id, d)
            t[m + "down_proj.weight"] = rn(d, Id)
        else:
            m = lp + "block_sparse_moe."
            t[m + "gate.weight"] = rn(E, d)
            t[m + "gate.e_score_correction_bias"] = torch.randn(E, generator=g) * 0.1
            t[m + "shared_experts.gate_proj.weight"] = rn(I * Ns, d)
            t[m + "shared_experts.up_proj.weight"] = rn(I * Ns, d)
            t[m + "shared_experts.down_proj.weight"] = rn(d, I * Ns)
            t[m + "routed_expert_down_proj.weight"] = rn(dl, d)
            t[m + "routed_expert_norm.weight"] = ones_ish(dl)
            t[m + "routed_expert_up_proj.weight"] = rn(d, dl)
            for ex in range(E):
                for wn, (n_out, n_in) in (("w1", (I, dl)), ("w3", (I, dl)), ("w2", (dl, I))):
                    t[m + f"experts.{ex}.{wn}.weight_packed"] = torch.randint(
                        0, 256, (n_out, n_in // 2), generator=g, dtype=torch.int64
                    ).to(torch.uint8)
                    # 2^(b-127): fp4 magnitudes up to 6, aim for ~1/sqrt(n_in) scale
                    base = 127 - int(round(math.log2(math.sqrt(n_in)))) - 2
                    t[m + f"experts.{ex}.{wn}.weight_scale"] = torch.randint(
                        base - 1, base + 2, (n_out, n_in // 32), generator=g, dtype=torch.int64
                    ).to(torch.uint8)
    return t, cfg


if __name__ == "__main__":
    torch.manual_seed(0)
    # dequant spot checks
    pk = torch.tensor([[0x21, 0xF8] + [0] * 14], dtype=torch.uint8)
    sc = torch.tensor([[128]], dtype=torch.uint8)
    dq = naive_dequant_mxfp4(pk, sc)
    assert dq[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0], dq[0, :4]
    # SiTU: act(0, .) = 0 and reduces to silu-like for small values
    assert float(naive_situ_glu(torch.tensor(0.0), torch.tensor(3.0), 4.0, 25.0)) == 0.0
    # Mix with one source is identity
    v = torch.randn(5, 7, dtype=F64)
    assert torch.equal(naive_attn_res_mix([v], torch.randn(1, 7), torch.ones(7), 1e-5), v)

    tensors, cfg = _random_k3_tiny()
    ids = [3, 17, 5, 60, 2, 9, 41, 33, 0, 12]
    logits = naive_forward(tensors, cfg, ids)
    assert logits.shape == (10, cfg["vocab_size"]) and logits.dtype == F64
    assert torch.isfinite(logits).all()
    ids2 = ids[:-1] + [(ids[-1] + 7) % cfg["vocab_size"]]
    logits2 = naive_forward(tensors, cfg, ids2)
    assert torch.equal(logits[:-1], logits2[:-1]), "causality violated"
    assert not torch.allclose(logits[-1], logits2[-1]), "last token change had no effect"
    # prefix consistency: forward on a prefix gives the same rows
    logits3 = naive_forward(tensors, cfg, ids[:6])
    assert torch.allclose(logits3, logits[:6], rtol=0, atol=1e-12)
    # plain residual variant also runs
    cfg_plain = dict(cfg, attn_res_block_size=None)
    lp = naive_forward(tensors, cfg_plain, ids)
    assert torch.isfinite(lp).all()
    print("logits std", float(logits.std()), "max |logit|", float(logits.abs().max()))
    print("naive_k3 sanity OK")

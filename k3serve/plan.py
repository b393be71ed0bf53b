"""Deployment arithmetic (seed 003, worked out by hand there): legal parallel layouts, whether the
weights fit, the per-GPU memory budget and the resulting cache capacity, from any model config.

The same checks run at engine start-up (``validate_layout``), before a single weight is loaded.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .cache.hit_rule import hit_boundary
from .config import ModelConfig

GIB = 1 << 30


class LayoutError(ValueError):
    """An impossible parallel layout, with the planner's explanation."""


def divisors(n: int) -> list[int]:
    return sorted({d for i in range(1, math.isqrt(n) + 1) if n % i == 0 for d in (i, n // i)})


def _factor(n: int) -> str:
    out, x, p = [], n, 2
    while p * p <= x:
        k = 0
        while x % p == 0:
            x //= p
            k += 1
        if k:
            out.append(f"{p}^{k}" if k > 1 else str(p))
        p += 1
    if x > 1:
        out.append(str(x))
    return " * ".join(out)


def tp_reason(cfg: ModelConfig, tp: int) -> str | None:
    """Why ``tp`` cannot split this model, or None when it can."""
    checks = [("attention heads", cfg.num_attention_heads), ("hidden size", cfg.hidden_size)]
    if cfg.num_kda_layers:
        checks.append(("KDA heads", cfg.kda_num_heads))
    bad = [f"{what} {n} (= {_factor(n)})" for what, n in checks if n and n % tp]
    if not bad:
        return None
    good = [f"{what} {n}" for what, n in checks if n and n % tp == 0]
    return f"TP={tp} does not divide the " + " nor the ".join(bad) + (f" (it divides the {', '.join(good)})" if good else "")


def ep_reason(cfg: ModelConfig, ep: int) -> str | None:
    if cfg.num_experts is None:
        return None if ep == 1 else "the model has no routed experts"
    if cfg.num_experts % ep:
        return f"EP={ep} does not divide the {cfg.num_experts} routed experts (= {_factor(cfg.num_experts)})"
    return None


def tp_candidates(cfg: ModelConfig, gpus: int) -> list[int]:
    heads = cfg.num_attention_heads or cfg.kda_num_heads
    cands = set(divisors(heads)) | {2 ** k for k in range(0, 12) if 2 ** k <= max(heads, gpus)}
    return sorted(c for c in cands if c <= max(heads, gpus))


def ep_candidates(cfg: ModelConfig, gpus: int) -> list[int]:
    if cfg.num_experts is None:
        return [1]
    common = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256}
    return sorted(c for c in set(divisors(cfg.num_experts)) | common if c <= max(gpus, 64) and c <= cfg.num_experts)


@dataclass
class WeightBytes:
    expert: int  # routed experts, as stored (MXFP4 packed + scales, or bf16)
    other: int  # everything else (bf16, a few fp32 vectors)

    @property
    def total(self) -> int:
        return self.expert + self.other

    def per_gpu(self, tp: int, ep: int) -> int:
        """Experts split over EP ranks (or over TP when EP = 1), the rest over TP (vocab-parallel
        embedding and head, head-split attention; norms and routers, < 0.1 %, counted as split)."""
        return self.expert // (ep if ep > 1 else tp) + self.other // tp


def checkpoint_bytes(cfg: ModelConfig) -> WeightBytes:
    """Exact stored bytes of the text model's checkpoint, from the config (meta tensors, no memory)."""
    from .model.k3 import K3ForCausalLM
    from .model.weights import _checkpoint_name, checkpoint_dtype

    model = K3ForCausalLM(cfg, torch.bfloat16, device="meta")
    expert = other = 0
    for name, p in model.named_parameters():
        ck = _checkpoint_name(name[len("model."):]) if name.startswith("model.") else name
        if ".experts." in ck:
            expert += p.numel() * p.element_size()  # uint8 when MXFP4-packed, else bf16
        else:
            other += p.numel() * torch.tensor([], dtype=checkpoint_dtype(ck, cfg)).element_size()
    return WeightBytes(expert, other)


def kda_state_bytes(cfg: ModelConfig, tp: int = 1, state_dtype_bytes: int = 4, conv_dtype_bytes: int = 2) -> int:
    """One request's KDA state on one GPU: every KDA layer's recurrent [H/tp, K, V] + conv window."""
    H, D, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    per_layer = (H // tp) * D * D * state_dtype_bytes + 3 * (H // tp) * D * (W - 1) * conv_dtype_bytes
    return cfg.num_kda_layers * per_layer


def mla_bytes_per_token(cfg: ModelConfig, dcp: int = 1, dtype_bytes: int = 2) -> float:
    """Latent KV per token on one GPU: replicated under TP (one shared latent head), striped under DCP."""
    return cfg.num_mla_layers * cfg.mla_cache_width * dtype_bytes / dcp


@dataclass
class LayoutPlan:
    tp: int
    ep: int
    dcp: int
    weights_gib_per_gpu: float
    fits: bool
    headroom_gib: float
    kda_mib_per_request: float
    mla_kib_per_token: float
    max_requests_at_context: int
    kv_token_capacity: int
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    model: str
    gpus: int
    nodes: int
    gpu_memory_gib: float
    reserve_gib: float
    context: int
    concurrency: int
    weights_total_gib: float
    expert_gib: float
    other_gib: float
    legal_tp: list[int]
    illegal_tp: dict[int, str]
    legal_ep: dict[int, int]  # EP -> experts per rank
    illegal_ep: dict[int, str]
    layouts: list[LayoutPlan]
    prefix_rule: dict

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(cfg: ModelConfig, gpus: int, gpu_memory_gib: float, nodes: int = 1, context: int = 131072,
              concurrency: int = 32, reserve_gib: float = 8.0, dcp_options: tuple[int, ...] = (1, 2, 4, 8),
              hash_block: int = 512, checkpoint_interval: int = 4096, name: str = "") -> Plan:
    if gpus < 1 or nodes < 1 or gpus % nodes:
        raise LayoutError(f"{gpus} GPUs cannot be spread evenly over {nodes} nodes" if gpus >= 1 and nodes >= 1
                          else f"--gpus and --nodes must be >= 1 (got {gpus}, {nodes})")
    for what, value, ok in (("--context", context, context >= 1), ("--concurrency", concurrency, concurrency >= 1),
                            ("--prefix-block-size", hash_block, hash_block >= 1),
                            ("--gpu-memory (GiB)", gpu_memory_gib, gpu_memory_gib > 0),
                            ("--reserve-gib", reserve_gib, reserve_gib >= 0)):
        if not ok:
            raise LayoutError(f"{what} out of range: {value}")
    if checkpoint_interval < hash_block or checkpoint_interval % hash_block:
        raise LayoutError(f"--kda-checkpoint-interval ({checkpoint_interval}) must be a multiple of "
                          f"--prefix-block-size ({hash_block})")
    w = checkpoint_bytes(cfg)
    tps = tp_candidates(cfg, gpus)
    illegal_tp = {tp: r for tp in tps if (r := tp_reason(cfg, tp))}
    legal_tp = [tp for tp in tps if tp not in illegal_tp]
    eps = ep_candidates(cfg, gpus)
    illegal_ep = {ep: r for ep in eps if (r := ep_reason(cfg, ep))}
    legal_ep = {ep: (cfg.num_experts or 0) // ep for ep in eps if ep not in illegal_ep}
    per_node = gpus // nodes
    layouts = []
    for tp in legal_tp:
        if tp > gpus:
            continue
        ep = tp if cfg.num_experts and cfg.num_experts % tp == 0 else 1
        for dcp in dcp_options:
            if dcp > tp or tp % dcp:
                continue  # DCP stripes the KV across the ranks of a TP group
            weights = w.per_gpu(tp, ep)
            headroom = gpu_memory_gib * GIB - reserve_gib * GIB - weights
            kda = kda_state_bytes(cfg, tp)
            mla = mla_bytes_per_token(cfg, dcp)
            per_req = kda + context * mla
            notes = []
            if tp > per_node:
                notes.append(f"TP={tp} spans {-(-tp // per_node)} nodes: every token's all-reduce crosses the network")
            layouts.append(LayoutPlan(
                tp=tp, ep=ep, dcp=dcp, weights_gib_per_gpu=round(weights / GIB, 2), fits=headroom > 0,
                headroom_gib=round(headroom / GIB, 2), kda_mib_per_request=round(kda / 2**20, 2),
                mla_kib_per_token=round(mla / 1024, 4),
                max_requests_at_context=max(0, int(headroom // per_req)) if headroom > 0 else 0,
                kv_token_capacity=max(0, int((headroom - concurrency * kda) // mla)) if headroom > 0 else 0,
                notes=notes))
    ckpts = {2 * hash_block, 5 * hash_block}
    rule = dict(
        hash_block=hash_block, kda_checkpoint_interval=checkpoint_interval, mla_page=64,
        rule="reuse = the longest hash-aligned position inside the token match that has a KDA checkpoint",
        examples=[dict(matched=m, checkpoints=sorted(c), reused=hit_boundary(m, c, hash_block))
                  for m, c in ((2800, ckpts), (2800, set()), (6000, {5120}), (511, {512}))])
    return Plan(model=name, gpus=gpus, nodes=nodes, gpu_memory_gib=gpu_memory_gib, reserve_gib=reserve_gib,
                context=context, concurrency=concurrency, weights_total_gib=round(w.total / GIB, 2),
                expert_gib=round(w.expert / GIB, 2), other_gib=round(w.other / GIB, 2), legal_tp=legal_tp,
                illegal_tp=illegal_tp, legal_ep=legal_ep, illegal_ep=illegal_ep, layouts=layouts, prefix_rule=rule)


def format_plan(p: Plan) -> str:
    lines = [f"model {p.model}: weights {p.weights_total_gib} GiB (routed experts {p.expert_gib} GiB as stored, "
             f"rest {p.other_gib} GiB); {p.gpus} GPU(s) x {p.gpu_memory_gib} GiB on {p.nodes} node(s), "
             f"runtime reserve {p.reserve_gib} GiB", "",
             f"legal TP: {p.legal_tp}"]
    lines += [f"  TP={tp} illegal: {r}" for tp, r in p.illegal_tp.items()]
    lines += ["", "legal EP: " + ", ".join(f"{ep} ({n} experts/rank)" for ep, n in p.legal_ep.items())]
    lines += [f"  EP={ep} illegal: {r}" for ep, r in p.illegal_ep.items()]
    lines += ["", f"per-GPU budget at context {p.context} tokens, {p.concurrency} concurrent requests:",
              "  TP  EP DCP | weights GiB | fits | headroom GiB | KDA MiB/req | MLA KiB/token | max req @ctx | KV tokens"]
    for lp in p.layouts:
        lines.append(f"  {lp.tp:>2} {lp.ep:>3} {lp.dcp:>3} | {lp.weights_gib_per_gpu:>11} | {'yes' if lp.fits else 'NO':>4} | "
                     f"{lp.headroom_gib:>12} | {lp.kda_mib_per_request:>11} | {lp.mla_kib_per_token:>13} | "
                     f"{lp.max_requests_at_context:>12} | {lp.kv_token_capacity:>9}"
                     + (f"   ({'; '.join(lp.notes)})" if lp.notes else ""))
    fitting = sorted({lp.tp for lp in p.layouts if lp.fits})
    lines += ["", f"layouts whose weights fit: TP in {fitting}" if fitting else "no legal layout fits these GPUs"]
    r = p.prefix_rule
    lines += ["", f"prefix cache: hash blocks of {r['hash_block']} tokens, MLA pages of {r['mla_page']}, KDA "
              f"checkpoints every {r['kda_checkpoint_interval']} tokens and at each prompt end;", f"  {r['rule']}:"]
    lines += [f"  matched {e['matched']} with checkpoints {e['checkpoints']} -> reuse {e['reused']}" for e in r["examples"]]
    return "\n".join(lines)


def validate_layout(cfg: ModelConfig, tp: int = 1, ep: int = 1, dcp: int = 1, gpu_memory_gib: float | None = None,
                    reserve_gib: float = 8.0, implemented: tuple[int, int, int] = (1, 1, 1)) -> None:
    """Start-up check, before any weight loads: illegal or unfitting layouts raise LayoutError."""
    problems = [r for r in (tp_reason(cfg, tp), ep_reason(cfg, ep)) if r]
    if dcp < 1 or tp % dcp:
        problems.append(f"DCP={dcp} must divide TP={tp} (it stripes the KV over the ranks of a TP group)")
    if problems:
        legal = [t for t in tp_candidates(cfg, tp) if not tp_reason(cfg, t)]
        raise LayoutError("; ".join(problems) + f". Legal TP degrees for this model: {legal}")
    if gpu_memory_gib is not None:
        per_gpu = checkpoint_bytes(cfg).per_gpu(tp, ep) / GIB
        if per_gpu + reserve_gib > gpu_memory_gib:
            raise LayoutError(f"the weights need {per_gpu:.2f} GiB per GPU at TP={tp}, EP={ep}; with a "
                              f"{reserve_gib} GiB runtime reserve that exceeds the GPU's {gpu_memory_gib:.2f} GiB "
                              "(run `k3serve plan` for the layouts that fit)")
    if (tp, ep, dcp) != implemented:
        raise LayoutError(f"TP={tp}, EP={ep}, DCP={dcp} is a legal layout, but this engine runs on one device "
                          "so far (multi-GPU parallelism is a later issue)")

"""GPU check of the single-purpose Triton kernels against their torch references at model sizes
(run on the H200; not a CI test, where the same kernels run through Triton's interpreter on small
shapes): the varlen short conv, the gated output norm, the MoE combine, the MLA flash prefill and
the split-KV MLA decode and the latent cache write, the router, the dense split-K GEMV and the
fused KDA decode mixer (each way of splitting a head over programs), and the MXFP4 grouped GEMM on
weights in the MMA layout (every tuned tile). Fresh random inputs, mixed decode / prefill batches
with cached context.

Also the Gluon kernels (moe_gluon, kda_decode_gluon, mla_decode_gluon) against the same references.

Usage: python bench/gpu_check_kernels.py [--no-gluon | --gluon mla|kda|moe | --short-conv | --moe-bf16 | --mla-prefill
       | --mla-decode | --kda-fused | --sampling | --norms]
(prints one row per check; exit code 1 if any fails)
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
import triton

from bench.compare import rel
from bench.mla_prefill_sdpa import mla_prefill_sdpa
from bench.overrides import constants
from k3serve.engine.transfer import copy_staged
from k3serve.model.batch import ForwardBatch, SeqChunk
from k3serve.model.layers import RMSNorm, rms_norm
from k3serve.ops import attn_res_triton, mla_decode_gluon, mla_ref
from k3serve.ops.attn_res_triton import attn_res_mix, attn_res_summary
from k3serve.ops.gemv_triton import GEMV_CONFIGS, gemv
from k3serve.ops.kda import kda_core
from k3serve.ops.kda_decode_triton import kda_decode_fused
from k3serve.ops.kda_ref import kda_gate
from k3serve.ops.mla_decode_triton import mla_decode
from k3serve.ops.mla_prefill_triton import mla_prefill, mla_prefill_varlen
from k3serve.ops import moe_triton
from k3serve.ops import expert_sort
from k3serve.ops.expert_sort import sort_by_expert, sort_by_expert_sizes
from k3serve.ops.moe_triton import combine_experts, grouped_gemm, route_triton, router_logits
from k3serve.ops.mxfp4 import dequantize_mxfp4, quantize_mxfp4, to_mma_layout
from k3serve.ops.moe_ref import route
from k3serve.ops.norm_triton import add_rms_norm_triton, latent_to_cache, rms_norm_triton
from k3serve.ops.short_conv import l2norm_heads, short_conv_ref
from k3serve.ops.short_conv_triton import short_conv_triton

DEV = os.environ.get("K3SERVE_CHECK_DEVICE", "cuda")  # cpu: a smoke run through the interpreter
ROWS: list[tuple[str, str, float, float]] = []


def record(name: str, shape: str, err: float, tol: float) -> None:
    ROWS.append((name, shape, err, tol))
    print(f"| {name} | {shape} | {err:.2e} | {tol:.0e} | {'ok' if err <= tol else 'FAIL'} |", flush=True)


def check_short_conv(C: int, layout: list[tuple[int, int]], gen: torch.Generator, head: int = 128) -> None:
    chunks = [SeqChunk([0] * q, ctx, slot, list(range(-(-(q + ctx) // 64)))) for slot, (q, ctx) in enumerate(layout)]
    batch = ForwardBatch.build(chunks, 64, DEV)
    T = batch.num_tokens
    x = torch.randn(T, C + 64, generator=gen, device=DEV).bfloat16()[:, 32:32 + C]
    w = torch.randn(C, 4, generator=gen, device=DEV) * 0.5
    state = torch.randn(len(layout) + 2, C, 3, generator=gen, device=DEV).bfloat16()
    ref_state, state0 = state.clone(), state.clone()
    ref = F.silu(short_conv_ref(x, w, ref_state, batch).float())
    planes = short_conv_triton(x, w, state, batch, plane=C // 3)
    out = planes.transpose(0, 1).reshape(T, C).float()
    record("short conv + SiLU", f"C={C}, (new, ctx)={layout}", rel(out, ref), 2e-2)
    record("short conv state", f"C={C}", float(not torch.equal(state, ref_state)), 0.0)
    # q and k (the first two planes) L2-normalised per head in the kernel (kda.CONV_NORMS_QK)
    normed = short_conv_triton(x, w, state0, batch, plane=C // 3, norm=(2 * C // 3, head))
    ref_n = l2norm_heads(ref, 2 * C // 3, head)
    record("short conv + SiLU + q/k L2 norm", f"C={C} heads of {head}", rel(normed.transpose(0, 1).reshape(T, C).float(), ref_n), 2e-2)


def check_short_convs(gen: torch.Generator) -> None:
    check_short_conv(12288, [(1, 40), (1, 7), (2, 1), (8192, 0), (300, 129)], gen)  # kimi-linear: 3 x 32 x 128
    check_short_conv(3 * 96 * 128, [(1, 5), (2048, 64), (3, 0)], gen)  # K3 widths
    check_short_conv(3 * 4 * 48, [(1, 5), (300, 7), (3, 0)], gen, head=48)  # the bundled tiny model


def check_gated_norm(T: int, H: int, D: int, gen: torch.Generator) -> None:
    x = torch.randn(T, H, D, generator=gen, device=DEV).bfloat16()
    w = torch.rand(D, generator=gen, device=DEV) + 0.5
    gate = torch.randn(T, H * D + 100, generator=gen, device=DEV).bfloat16()[:, 50:50 + H * D]
    out = rms_norm_triton(x, w, 1e-6, torch.bfloat16, gate=gate)
    ref = rms_norm(x.float(), w, 1e-6, torch.float32) * torch.sigmoid(gate.float().view(T, H, D))
    record("gated RMSNorm", f"T={T} H={H} D={D}", rel(out, ref), 1e-2)


def check_add_norm(T: int, D: int, gen: torch.Generator) -> None:
    """The residual add + RMSNorm a layer boundary runs (``norm_triton.ADD_NORM_WARPS`` warps a row):
    the sum bit-equal to torch's bf16 add, the norm vs float64 of that sum (bf16 output)."""
    h, delta = (torch.randn(T, D, generator=gen, device=DEV).bfloat16() for _ in range(2))
    w = (torch.rand(D, generator=gen, device=DEV) + 0.5).bfloat16()
    h_out, y = add_rms_norm_triton(h, delta, w, 1e-6)
    s = (h + delta).double()
    ref = s / (s.square().mean(-1, keepdim=True) + 1e-6).sqrt() * w.double()
    record("add + RMSNorm" + ("" if torch.equal(h_out, h + delta) else " (SUM DIFFERS)"), f"T={T} D={D}",
           rel(y, ref) if torch.equal(h_out, h + delta) else float("inf"), 1e-2)


def check_combine(T: int, k: int, D: int, norm: bool, gen: torch.Generator) -> None:
    y = torch.randn(T * k, D, generator=gen, device=DEV)
    mod = None
    if norm:
        mod = RMSNorm(D, 1e-6, torch.float32, DEV)
        mod.weight.data = torch.rand(D, generator=gen, device=DEV) + 0.5
    add = None if norm else torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    out = combine_experts(y, k, mod, add, torch.bfloat16)
    ref = y.view(T, k, D).sum(1)
    ref = mod(ref, out_dtype=torch.float32) if mod is not None else ref + add.float()
    record("MoE combine", f"T={T} k={k} D={D} {'norm' if norm else 'add'}", rel(out, ref), 1e-2)


def check_mla_prefill(Ha: int, ctx: int, Tq: int, gen: torch.Generator, sdpa: bool = False, tma: bool = False) -> None:
    """Our flash kernel (autotuned; with ``tma`` its keys and values loaded by TMA), or with ``sdpa`` torch's
    SDPA (``bench.mla_prefill_sdpa``), vs fp32."""
    dn, dr, dv, rkv = 128, 64, 128, 512
    q = torch.randn(Tq, Ha, dn + dr, generator=gen, device=DEV).bfloat16()
    latent = torch.randn(ctx + Tq, rkv + dr, generator=gen, device=DEV).bfloat16()
    w = (torch.randn(Ha * (dn + dv), rkv, generator=gen, device=DEV) / rkv ** 0.5).bfloat16()
    scale = (dn + dr) ** -0.5
    with constants(f"k3serve.ops.mla_prefill_triton.TMA_LOADS={tma}"):
        out = (mla_prefill_sdpa if sdpa else mla_prefill)(q, latent, w, ctx, rkv, dn, scale)
    ref = mla_ref.mla_expanded_ref(q.float(), latent.float(), w.float(), ctx, rkv, dn, scale)
    record("MLA prefill, torch SDPA" if sdpa else f"MLA flash prefill (autotuned{', TMA loads' if tma else ''})",
           f"Ha={Ha} ctx={ctx} Tq={Tq}", rel(out, ref), 2e-2)


def check_mla_prefill_varlen(Ha: int, layout: list[tuple[int, int]], gen: torch.Generator, tma: bool = False) -> None:
    """Many prompts (context, new tokens) in one launch vs the fp32 reference on each alone."""
    dn, dr, dv, rkv = 128, 64, 128, 512
    w = (torch.randn(Ha * (dn + dv), rkv, generator=gen, device=DEV) / rkv ** 0.5).bfloat16()
    qs = [torch.randn(t, Ha, dn + dr, generator=gen, device=DEV).bfloat16() for _, t in layout]
    lats = [torch.randn(c + t, rkv + dr, generator=gen, device=DEV).bfloat16() for c, t in layout]
    starts = [(sum(t for _, t in layout[:i]), sum(c + t for c, t in layout[:i])) for i in range(len(layout))]
    seqs = torch.tensor([[q0, k0, c, t] for (q0, k0), (c, t) in zip(starts, layout)], dtype=torch.int32, device=DEV)
    scale = (dn + dr) ** -0.5
    with constants(f"k3serve.ops.mla_prefill_triton.TMA_LOADS={tma}"):
        out = mla_prefill_varlen(torch.cat(qs), torch.cat(lats), w, seqs, max(t for _, t in layout), rkv, dn, scale)
    ref = torch.cat([mla_ref.mla_expanded_ref(q.float(), lat.float(), w.float(), c, rkv, dn, scale)
                     for q, lat, (c, _) in zip(qs, lats, layout)])
    record(f"MLA flash prefill, prompts in one launch{', TMA loads' if tma else ''}", f"Ha={Ha} (ctx, new)={layout}",
           rel(out, ref), 2e-2)


def check_mla_decode(B: int, H: int, lens: list[int], gen: torch.Generator, gluon: bool = False,
                     width: int = 0, poison: bool = False) -> None:
    """The split-KV decode (Triton, or with ``gluon`` mla_decode_gluon's keys-major kernel) vs the
    fp32 reference, its table row-major and page-major (a static step's) with ``width`` pages a row
    (a long max_model_len's: most splits empty; past each row's pages other valid page ids); then
    (Triton only) the latent rows' cache store."""
    rkv, dr, page = 512, 64, 64
    need = max(-(-n // page) for n in lens) + 2
    pool = torch.randn(B * need + 5, page, rkv + dr, generator=gen, device=DEV).bfloat16()
    table = torch.randint(0, pool.shape[0], (B, max(width, need)), generator=gen, device=DEV)
    table[:, :need] = torch.randperm(pool.shape[0], generator=gen, device=DEV)[: B * need].view(B, need)
    by_page = torch.empty(table.numel(), dtype=table.dtype, device=DEV).as_strided(table.shape, (1, B)).copy_(table)
    seq_lens = torch.tensor(lens, device=DEV)
    if poison:  # NaN in every row no sequence holds (the pool's other pages, each last page's tail): never read
        keep = torch.zeros(pool.shape[0] * page, dtype=torch.bool, device=DEV)
        for i, n in enumerate(lens):
            keep[(table[i, :need, None] * page + torch.arange(page, device=DEV)).flatten()[:n]] = True
        pool.view(-1, rkv + dr)[~keep] = float("nan")
    q = torch.randn(B, H, rkv + dr, generator=gen, device=DEV).bfloat16()
    S = need * page
    lat = pool[table[:, :need]].flatten(1, 2).float().nan_to_num(0.0)  # (masked rows: 0 x NaN is NaN)
    mask = torch.arange(S, device=DEV)[None, :] < seq_lens[:, None]
    ref = mla_ref.mla_absorbed_ref(q.float()[:, None], lat, mask[:, None], rkv, 0.07)[:, 0]
    for name, t in (("", table), (", page-major table", by_page)):
        out = mla_decode(q, pool, t, seq_lens, rkv, 0.07, gluon=gluon)
        major = ", Gluon seesaw" if mla_decode_gluon.SEESAW else ", Gluon heads-major"
        major += ", TMA ring" if mla_decode_gluon.SEESAW and mla_decode_gluon.tma_ring_applies(pool) else ""
        form = (major if mla_decode_gluon.heads_major_applies(H) else ", Gluon") if gluon else ""
        form += ", head blocks first" if gluon and mla_decode_gluon.HEAD_BLOCKS_FIRST else ""
        record("MLA split-KV decode (default splits)" + form + name + ", NaN outside the keys" * poison,
               f"B={B} H={H} lens={lens[:4]} width={t.shape[1]}", rel(out, ref), 2e-2)
    if gluon:
        return
    # the new rows' latent norm, k_pe and their cache store in one launch
    kv = torch.randn(B, 7 + rkv + dr, generator=gen, device=DEV).bfloat16()[:, 7:]
    nw = (torch.rand(rkv, generator=gen, device=DEV) + 0.5).bfloat16()
    slot = torch.randperm(pool.shape[0] * page, generator=gen, device=DEV)[:B]
    before = pool.clone()
    latent_to_cache(kv, nw, 1e-6, pool, slot // page, slot % page)
    before[slot // page, slot % page] = torch.cat([rms_norm_triton(kv[:, :rkv], nw, 1e-6), kv[:, rkv:]], -1)
    record("MLA latent rows to cache (1 = differs from norm + cat + store)", f"T={B}",
           float(not torch.equal(pool, before)), 0.0)


def _kept_float64(x: torch.Tensor, tk: torch.Tensor, tp: torch.Tensor, mp: torch.Tensor, band: float = 1e-4):
    """What top-k, top-p (on the top-k's renormalised mass) and min-p keep of x [S, V], from a sort
    in float64, and the tokens at a boundary: a prefix mass within ``band`` of top_p, or a
    probability ratio to the top within ``band`` relative of min_p (where fp32 sums may decide
    either way)."""
    V = x.shape[1]
    xs, order = x.double().sort(-1, descending=True)
    xs = xs.masked_fill(torch.arange(V, device=x.device) >= torch.where(tk > 0, tk, V)[:, None], float("-inf"))
    probs = xs.softmax(-1)
    before = probs.cumsum(-1) - probs
    ratio = (xs - xs[:, :1]).exp()
    keep = (xs > float("-inf")) & ~((before >= tp[:, None]) & (tp < 1)[:, None]) & (ratio >= mp[:, None])
    edge = (((before - tp[:, None]).abs() < band) & (tp < 1)[:, None]) | ((ratio - mp[:, None]).abs() < band * mp[:, None])
    back = lambda t: torch.empty_like(t).scatter_(1, order, t)  # noqa: E731
    return back(keep), back(edge)


def check_sampling(S: int, V: int, gen: torch.Generator, peaked: bool = False) -> None:
    """The sort-free sampling kernel (one launch, rows split between programs at grid barriers):
    its kept sets against a float64 sort (rows differing at a token off the fp32 boundary band: 0),
    and its tokens against the sorting fp32 path's on the same noise wherever their kept sets agree.
    ``peaked``: half the rows with a few tokens far above the rest (as a model's logits: the later
    passes skip most blocks, ``sampling_triton.SKIP``); the kept sets and tokens with skipping off
    are the same."""
    from k3serve.engine.sampler import filter_logits
    from k3serve.ops.sampling_triton import BLOCK, keys, sample_filtered

    logits = torch.randn(S, V, generator=gen, device=DEV) * (torch.rand(S, 1, generator=gen, device=DEV) * 6 + 0.5)
    if peaked:  # half the rows peaked: 20 tokens 15-20 above a bulk of scale 0.5
        bulk = torch.randn(S // 2, V, generator=gen, device=DEV) * 0.5
        logits[: S // 2] = bulk.scatter_(1, torch.randint(0, V, (S // 2, 20), generator=gen, device=DEV),
                                           15 + 5 * torch.rand(S // 2, 20, generator=gen, device=DEV))
    logits[0, V // 3:] = float("-inf")
    rows = torch.randperm(S, generator=gen, device=DEV)
    temp = torch.rand(S, generator=gen, device=DEV) + 0.5
    x = logits[rows] / temp[:, None]
    q = torch.empty(S, V, device=DEV).exponential_(generator=gen)
    for top_k, top_p, min_p in [((0,), (0.95,), (0.0,)), ((0, 50, 7), (0.9, 1.0, 0.5), (0.0, 0.0, 0.1)),
                                ((40,), (1.0,), (0.0,)), ((0,), (1.0,), (0.05,))]:
        tk = torch.tensor([top_k[i % len(top_k)] for i in range(S)], device=DEV)
        tp = torch.tensor([top_p[i % len(top_p)] for i in range(S)], dtype=torch.float32, device=DEV)
        mp = torch.tensor([min_p[i % len(min_p)] for i in range(S)], dtype=torch.float32, device=DEV)
        tau = torch.empty(S, dtype=torch.int64, device=DEV)
        args = (logits, rows, q, torch.stack([temp, tk.float(), tp, mp]), max(top_k) > 0, min(top_p) < 1,
                max(min_p) > 0)
        tok = sample_filtered(*args, tau=tau)
        tau_all = torch.empty_like(tau)
        tok_all = sample_filtered(*args, tau=tau_all, skip=False)
        kept = (keys(x) >= tau[:, None]) & (x > float("-inf"))
        kept &= torch.exp(x - x.max(1, keepdim=True).values) >= mp[:, None]
        exact, edge = _kept_float64(x, tk, tp.double(), mp.double())
        ref = filter_logits(x, tk, tp, mp)
        shape = f"S={S} V={V} top_k={top_k} top_p={top_p} min_p={min_p}" + (" peaked" if peaked else "")
        pad = torch.nn.functional.pad(x, (0, -V % BLOCK), value=float("-inf"))
        skipped = (keys(pad.view(S, -1, BLOCK).amax(2)) < tau[:, None]).float().mean().item()
        print(f"|   (blocks the draw skips) | {shape} | {skipped:.3f} | | |")
        record("sampling: rows whose token or threshold changes with skipping off", shape,
               float(((tok != tok_all) | (tau != tau_all)).float().mean()), 0.0)
        record("sampling: rows keeping a token off the float64 sort's boundary", shape,
               float(((kept != exact) & ~edge).any(1).float().mean()), 0.0)
        same = (kept == (ref > float("-inf"))).all(1)
        print(f"|   (rows whose kept set equals the fp32 sort's) | {shape} | {same.float().mean().item():.3f} | | |")
        record("sampling: token differing from the fp32 sort's where the kept sets agree", shape,
               float((tok != (ref.softmax(-1) / q).argmax(-1))[same].float().mean().nan_to_num(0.0)), 0.0)


def check_attn_res_partial(M: int, T: int, D: int, gen: torch.Generator) -> None:
    """The AttnRes mixer doing the partial's pending update in its pass (``attn_res.FUSE_PARTIAL``):
    the buffer and the output bit for bit those of torch's add (or copy) first, then the mix."""
    q, w = torch.randn(D, generator=gen, device=DEV), torch.rand(D, generator=gen, device=DEV) + 0.5
    buf = torch.randn(M, T, D, generator=gen, device=DEV).bfloat16()
    delta = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    split = attn_res_triton.split_shape(M, D, T, buf.device)
    split = f" split {split['SPLIT']} x {split['COLS']}" if split else ""
    for reset in (False, True):
        first = buf.clone()
        (first[-1].copy_ if reset else first[-1].add_)(delta)
        expect = attn_res_mix(first, q, 1e-5, w, torch.bfloat16)
        fused = buf.clone()
        got = attn_res_mix(fused, q, 1e-5, w, torch.bfloat16, (delta, reset))
        record("AttnRes mix + partial update (1 = differs from update first)", f"M={M} T={T} D={D} reset={reset}{split}",
               float(not (torch.equal(fused, first) and torch.equal(got, expect))), 0.0)
        record("AttnRes mix vs float64 (bf16 output)", f"M={M} T={T} D={D} reset={reset}{split}",
               rel(got.double(), _mix64(first, q, w)), 1e-2)


def _mix64(v: torch.Tensor, q: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """The AttnRes mix of sources v [M, T, D] in float64 (then the RMSNorm with w, unless None)."""
    v = v.double()
    score = (v * q.double()).sum(-1) / torch.sqrt((v * v).mean(-1) + 1e-5)
    mix = (torch.softmax(score, 0)[..., None] * v).sum(0)
    return mix if w is None else mix / torch.sqrt((mix * mix).mean(-1, keepdim=True) + 1e-5) * w.double()


def check_attn_res_summary(M: int, T: int, D: int, Q: int, gen: torch.Generator) -> None:
    """A block summary (``attn_res_summary``: the block's first mixer, its last block's pending update
    in the pass, and the M blocks mixed for each of Q queries) and the mixers that read a summary
    row and the partial (its update, add or reset, in the pass), against float64 mixes over all
    the sources; the updates bit for bit torch's."""
    queries = torch.randn(Q, D, generator=gen, device=DEV)
    w = torch.rand(D, generator=gen, device=DEV) + 0.5
    buf = torch.randn(M, T, D, generator=gen, device=DEV).bfloat16()
    delta = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    blocks = buf.clone()
    blocks[-1].add_(delta)
    summary = torch.empty(Q, T, 2, D, dtype=torch.bfloat16, device=DEV)
    logits = torch.empty(Q, T, device=DEV)
    first = attn_res_summary(buf, queries, 1e-5, w, torch.bfloat16, (delta, False), summary, logits)
    shape = f"M={M} T={T} D={D} Q={Q}"
    record("AttnRes summary: block update (1 = differs from torch's add)", shape, float(not torch.equal(buf, blocks)), 0.0)
    record("AttnRes summary: first mixer vs float64 (bf16 output)", shape, rel(first.double(), _mix64(blocks, queries[0], w)),
           1e-2)
    v = blocks.double()
    scores = torch.einsum("qd,mtd->qmt", queries.double(), v) / torch.sqrt((v * v).mean(-1) + 1e-5)
    ref = torch.einsum("qmt,mtd->qtd", torch.softmax(scores, 1), v)
    record("AttnRes summary rows (high + low) vs float64", shape, rel(summary.double().sum(-2), ref), 2e-5)
    record("AttnRes summary logits vs float64", shape, rel(logits.double(), torch.logsumexp(scores, 1)), 1e-5)
    partial = torch.randn(1, T, D, generator=gen, device=DEV).bfloat16()
    for j in (1, Q - 1):
        for reset in (False, True):
            fused, updated = partial.clone(), partial.clone()
            (updated[0].copy_ if reset else updated[0].add_)(delta)
            got = attn_res_mix(fused, queries[j], 1e-5, w, torch.bfloat16, (delta, reset), (summary[j], logits[j]))
            record("AttnRes mix of a summary + partial update (1 = differs from torch's)", f"{shape} j={j} reset={reset}",
                   float(not torch.equal(fused, updated)), 0.0)
            record("AttnRes mix of a summary vs float64 (bf16 output)", f"{shape} j={j} reset={reset}",
                   rel(got.double(), _mix64(torch.cat([blocks, updated]), queries[j], w)), 1e-2)


def check_router(T: int, E: int, D: int, K: int, gen: torch.Generator) -> None:
    """bf16 x and weight through the tensor cores (exact products, fp32 sums) vs float64; then the
    partial sums finished by the route kernel vs torch's routing of the fp32 logits."""
    x = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    w = (torch.randn(E, D, generator=gen, device=DEV) * D ** -0.5).bfloat16()
    ref = F.linear(x.double(), w.double())
    parts = router_logits(x, w, split=True)
    record("router logits (partial sums, bf16 MMA)", f"T={T} E={E} D={D}", rel(parts.sum(0), ref), 1e-6)
    bias = torch.randn(E, generator=gen, device=DEV) * 0.1
    w_ref, ids_ref = route(ref.float(), bias, K, 1, 1, True, 2.5, "sigmoid")
    wt, ids = route_triton(parts, bias, K, True, 2.5, "sigmoid")
    same = (ids.sort(1).values == ids_ref.sort(1).values).all(1).float().mean().item()
    record("route from partial sums: tokens with the same experts", f"T={T} E={E} K={K}", 1 - same, 0.05)


def check_add_norm_router(T: int, E: int, D: int, gen: torch.Generator) -> None:
    """The add + RMSNorm before a MoE layer with the router's partial logits in one launch: h + delta
    and the norm bit-equal to ``add_rms_norm_triton`` (rows strided), the logits of the rounded norm
    vs float64."""
    h = torch.randn(T, D + 64, generator=gen, device=DEV).bfloat16()[:, 32:32 + D]
    delta = torch.randn(T, D, generator=gen, device=DEV).bfloat16()
    nw = (1 + torch.randn(D, generator=gen, device=DEV) / 4).bfloat16()
    w = (torch.randn(E, D, generator=gen, device=DEV) * D ** -0.5).bfloat16()
    h2, y2, parts = moe_triton.add_norm_router_logits(h, delta, nw, 1e-6, w)
    h1, y1 = add_rms_norm_triton(h, delta, nw, 1e-6)
    differ = int((h1 != h2).sum() + (y1 != y2).sum())
    record("add + RMSNorm + router logits: elements unlike add_rms_norm", f"T={T} E={E} D={D}", differ, 0)
    record("add + RMSNorm + router logits: logits", f"T={T} E={E} D={D}",
           rel(parts.sum(0), F.linear(y1.double(), w.double())), 1e-6)


def norm_checks(gen: torch.Generator) -> None:
    """The norms a layer boundary runs: add + RMSNorm (a row a program, and 32-row tiles at 4100 x 128),
    the gated output norm, and the add + norm fused with the router's logits (bit-equal to the first)."""
    for T, D in ((1, 2304), (16, 2304), (3, 7168), (8192, 2304), (4100, 128)):
        check_add_norm(T, D, gen)
    check_gated_norm(8192, 32, 128, gen)
    check_gated_norm(3, 96, 128, gen)
    for T, E, D in ((1, 256, 2304), (4, 256, 2304), (1, 896, 7168)):
        check_add_norm_router(T, E, D, gen)


def check_router_prefill(T: int, E: int, D: int, flag: str, tol: float, gen: torch.Generator) -> None:
    """A prefill router GEMM behind ``moe_triton.<flag>`` vs float64: ``ROUTER_PREFILL_MMA`` (K3's
    reference form, cuBLAS bf16 in / fp32 out) at that form's own precision (2.4e-6 at D 2304 and
    7.9e-6 at 7168 measured, sixteenth session); ``ROUTER_PREFILL_KERNEL`` (ours: MMA per chunk of
    D, chunk sums in fp32 registers) at the default path's fp32 tolerance (check_router)."""
    x = torch.randn(T, D + 64, generator=gen, device=DEV).bfloat16()[:, 32:32 + D]  # strided rows
    w = (torch.randn(E, D, generator=gen, device=DEV) * D ** -0.5).bfloat16()
    setattr(moe_triton, flag, True)
    try:
        got = router_logits(x, w)
    finally:
        setattr(moe_triton, flag, False)
    record(f"router logits, {flag} (opt-in)", f"T={T} E={E} D={D}", rel(got, F.linear(x.double(), w.double())), tol)


def check_expert_sort(T: int, E: int, top: int, sizes: tuple, gen: torch.Generator) -> None:
    """expert_sort's two launches (``expert_sort.SORT_KERNEL``) vs the torch form
    (``layout_mismatches``: owners, padding, each row in its expert, each once; row order inside an
    expert follows the atomics); run twice (its counters must return to zero)."""
    ids = torch.rand(T, E, device=DEV, generator=gen).topk(top, dim=-1).indices
    ref = expert_sort._sort_torch(ids, E, sizes)
    bad = 0
    for _ in range(2):
        got = expert_sort.sort_by_expert_kernel(ids, E, sizes, tuple(expert_sort._sort_totals(ids.numel(), E, sizes)))
        problems = expert_sort.layout_mismatches(ids, ref, got)
        if problems:
            print("expert sort:", problems)
        bad += len(problems)
    record("expert sort, two launches: layout problems", f"T={T} E={E} top {top} sizes {sizes}", bad, 0)


def check_copy_staged(p: int, tail: int, cut: int) -> None:
    """A static step's staged inputs moved in (engine/transfer.py ``copy_staged``): p input tokens,
    their pending rows (a third replaced by int32 device tokens), ``tail`` other entries, the last
    ``cut`` not sent; against the same written out in torch on the host. Mismatched entries."""
    rows = torch.full((p,), -1, dtype=torch.int64)
    pick = torch.randperm(p)[:max(1, p // 3)]
    rows[pick] = torch.randint(0, p, (pick.numel(),))
    src = torch.cat([torch.randint(0, 163840, (p,)), rows, torch.randint(-1, 4096, (tail,))])
    tokens = torch.randint(0, 163840, (p,), dtype=torch.int32)
    n = src.numel() - cut
    want = torch.full_like(src, -5)
    want[:n] = src[:n]
    want[pick] = tokens[rows[pick]].long()
    got = torch.full_like(src, -5, device=DEV)
    copy_staged(got, src.to(DEV), n, p, tokens.to(DEV))
    record("staged inputs + pending tokens (copy_staged)", f"p={p} tail={tail} cut={cut}",
           int((got.cpu() != want).sum()), 0)


def copy_staged_checks() -> None:
    for p, tail, cut in ((1, 5, 0), (64, 64 * 4 + 64 * 40, 64 * 30), (8208, 30000, 1000)):
        check_copy_staged(p, tail, cut)


def check_gemv(T: int, K: int, N: int, gen: torch.Generator) -> None:
    """bf16 through the tensor cores vs float64, autotuned and every pinned tile (split-K partials
    summed by the last program of each column block; each tile run twice: tickets reset), the
    weight also as a static one (read before the PDL wait where a program's K range is one tile)."""
    x = torch.randn(T, K, generator=gen, device=DEV).bfloat16()
    w = (torch.randn(N, K, generator=gen, device=DEV) * K ** -0.5).bfloat16()
    ref = F.linear(x.double(), w.double())
    worst = max(rel(gemv(x, w), ref), rel(gemv(x, w, static_weight=True), ref))
    for c in GEMV_CONFIGS:
        cfg = dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
        worst = max(worst, *(rel(gemv(x, w, cfg, static_weight=s), ref) for s in (False, True, False, True)))
    record("dense GEMV (split-K, all tiles)", f"T={T} K={K} N={N}", worst, 1e-2)


def check_gemv_batched(B: int, T: int, K: int, N: int, fp32_x: bool, gen: torch.Generator) -> None:
    """The batched GEMV as the model calls it (KDA f/g up-projections; MLA's query absorption, and
    W_UV on the fp32 latent output into an fp32 out): strided x and out views, a weight that is a
    slice of a larger per-batch matrix, vs float64 of the bf16-rounded inputs; run twice."""
    x = torch.randn(T, B, K + 64, generator=gen, device=DEV)[..., :K].transpose(0, 1)
    x = x if fp32_x else x.bfloat16()
    w = (torch.randn(B, N + 32, K, generator=gen, device=DEV) * K ** -0.5).bfloat16()[:, 32:]
    ref = x.bfloat16().double() @ w.double().transpose(1, 2)
    out = torch.full((T, B, N), float("nan"), device=DEV, dtype=torch.float32 if fp32_x else torch.bfloat16)
    worst = max(rel(gemv(x, w, out=out.transpose(0, 1), static_weight=s), ref) for s in (False, True, True))
    record("batched GEMV (strided x / out" + (", fp32 x and out)" if fp32_x else ")"), f"B={B} T={T} K={K} N={N}",
           worst, 1e-5 if fp32_x else 1e-2)


KDA_FUSED_SHAPES = ((1, 32, -5.0), (5, 96, None), (64, 32, -5.0), (300, 96, -5.0))  # (N, H, lower bound)


def check_kda_fused(N: int, H: int, D: int, lb: float | None, gen: torch.Generator, gluon: bool = False) -> None:
    """The fused decode mixer (conv, gates, norms, delta rule, gated RMSNorm) vs the reference
    mixer, a head as one program, as one program per value block (the ticket), and by the rule;
    with ``gluon`` kda_decode_gluon's program a head alone."""
    P, W, S = H * D, 4, N + 3
    x = torch.randn(N, 3 * P, generator=gen, device=DEV)
    conv_w = torch.randn(3 * P, W, generator=gen, device=DEV) * 0.5
    f, gate = torch.randn(N, P, generator=gen, device=DEV) * 2, torch.randn(N, P, generator=gen, device=DEV)
    b = torch.randn(N, H, generator=gen, device=DEV)
    A_log, dt_bias = torch.rand(H, generator=gen, device=DEV) * 2, torch.randn(P, generator=gen, device=DEV)
    onw = torch.rand(D, generator=gen, device=DEV) + 0.5
    conv0 = torch.randn(S, 3 * P, W - 1, generator=gen, device=DEV)
    state0 = torch.randn(S, H, D, D, generator=gen, device=DEV) * 0.2
    slots = torch.randperm(S, generator=gen, device=DEV)[:N]
    ctx = [(7 * i) % 11 for i in range(N)]  # some fresh sequences (context 0): their slots must not be read
    batch = ForwardBatch.build([SeqChunk([0], c, int(s), [0]) for c, s in zip(ctx, slots.tolist())], 64, DEV)
    conv_r, state_r = conv0.clone(), state0.clone()
    u = F.silu(short_conv_ref(x, conv_w, conv_r, batch))
    q, k, v = (t.reshape(N, H, D) for t in u.split(P, dim=-1))
    o = kda_core(q, k, v, kda_gate(f.view(N, H, D), A_log, dt_bias, lb), torch.sigmoid(b), D ** -0.5, state_r, batch,
                 backend="torch")
    y_ref = (rms_norm(o, onw, 1e-5, torch.float32) * torch.sigmoid(gate.view(N, H, D))).reshape(N, P)
    has = torch.tensor(ctx, device=DEV) > 0
    forms = ((64, 1, "heads"), (64, 1, "sequences")) if gluon else ((64, 1, "heads"), (64, 2, "heads"), (32, 4, "heads"),
                                               (64, None, "heads"), (64, 1, "sequences"), (64, 2, "memory"),
                                               (32, 4, "memory"))
    for bv, parts, order in forms:
        conv_t, state_t = conv0.clone(), state0.clone()
        with constants(f"k3serve.ops.kda_decode_triton.LAUNCH_ORDER={order!r}"):
            y = kda_decode_fused(x, conv_w, conv_t, has, f, b, A_log, dt_bias, gate, onw, 1e-5, lb, state_t, slots, H,
                                 block_v=bv, parts=parts, gluon=gluon)
        err = max(rel(y, y_ref), rel(state_t, state_r), rel(conv_t, conv_r))
        record("KDA fused decode mixer" + (", Gluon" if gluon else ""),
               f"N={N} H={H} D={D}" + (f" {order} fastest" if gluon else f" block {bv}, parts {parts}, {order} fastest"),
               err, 1e-4)


def check_mxfp4_mma(T: int, E: int, N: int, K: int, top: int, gen: torch.Generator, upcast: str = "mma",
                    block_m: int | tuple | None = None) -> None:
    """Gate / up GEMM with the SiLU-GLU epilogue, and a plain one, over MXFP4 stacks rewritten into
    the MMA layout, against fp32 matmuls of the exactly dequantised weights; rows of widely
    different scales (2^-20 .. 2^4; .. 2^1 for the Gluon kernel, whose folded multiply takes E8M0
    bytes up to 128). "mma": every tuned tile of the Triton kernel; "gluon": moe_gluon's kernel.
    ``block_m`` a tuple: row blocks of those sizes (``sort_by_expert_sizes``), one launch a size
    into one output, each with the kernel's default tile (as ``experts_triton`` runs them), its
    programs ordered row block fastest, then column tile fastest."""
    top_exp = 5 if upcast == "mma" else 2

    def stack():
        w = torch.randn(E, N, K, device=DEV, generator=gen)
        w = w * torch.exp2(torch.randint(-20, top_exp, (E, N, 1), device=DEV, generator=gen).float())
        return quantize_mxfp4(w)
    (gp, gs), (upk, us) = stack(), stack()
    ids = torch.rand(T, E, device=DEV, generator=gen).topk(top, dim=-1).indices
    x = torch.randn(T, K, device=DEV, generator=gen).bfloat16()
    block_m = block_m or (16 if T * top < 16 * E else 64)
    sizes = block_m if isinstance(block_m, tuple) else None
    layouts = sort_by_expert_sizes(ids, E, sizes) if sizes else [(block_m, *sort_by_expert(ids, E, block_m))]
    xa = x.float()[torch.arange(T * top, device=DEV) // top]
    a = ids.flatten()
    gate = torch.einsum("ak,ank->an", xa, dequantize_mxfp4(gp, gs)[a])
    exact = {False: gate, True: F.silu(gate) * torch.einsum("ak,ank->an", xa, dequantize_mxfp4(upk, us)[a])}
    # every tuned Triton tile; the Gluon kernel's 4 warps (its gate / up chains do not fit row
    # blocks of 128: the single GEMM only there), and at prefill row blocks its 8-warp STACKED form
    # (its K steps a double buffer: no stages to vary)
    tiles = [False, True] if sizes else sorted(moe_triton._MMA_TILES) if upcast == "mma" else [
        (64, True, 4, 2)] + ([(64, True, 8, 2)] if block_m >= 64 else [])
    for tile in tiles:
        for glu in (False, True) if upcast == "mma" or sizes or block_m < 128 or tile[2] == 8 else (False,):
            kw = dict(tiles=dict(BLOCK_N=tile[0], SWAP_AB=tile[1], num_warps=tile[2], num_stages=tile[3])
                      if sizes is None else dict(cols_first=tile))
            out = torch.empty(T * top, N, device=DEV)
            for bm, rows, blocks in layouts:
                grouped_gemm(x, rows, blocks, T * top, top, to_mma_layout(gp), gs, N, bm,
                             up=(to_mma_layout(upk), us) if glu else None, mx_upcast=upcast, out=out, **kw)
            record(f"MXFP4 grouped GEMM, MMA layout, {upcast}" + (" + GLU" if glu else ""),
                   f"T={T} E={E} N={N} K={K} rows {block_m} tile " + (f"{tile[0]}/{tile[2]}w/{tile[3]}s" if sizes is None
                                                                      else f"default, cols first {tile}"),
                   rel(out, exact[glu]), 1e-4)


# moe_gluon's forms compiled and inspected on CPU but not yet checked on the H200 (sixtieth session)
GLUON_NEXT = "k3serve.ops.moe_gluon.ACC_STORE=True,k3serve.ops.moe_gluon.EARLY_ROWS=True"


def check_experts_split(T: int, gen: torch.Generator, E: int = 32, top: int = 9, shared: bool = False) -> None:
    """kimi-linear's experts quantised at load (``--quantization mxfp4``; 9 a token) through
    ``experts_triton``: a decode step's split-K Gluon GEMMs (partials summed by the GLU and the
    combine, ``moe_triton.GLUON_SPLIT_K_PER_SM``), then unsplit, against float64 of the dequantised
    weights with the intermediate rounded to bf16 as the kernels store it. ``shared``: the ninth is
    a shared expert joined to the stacks, as served (at one token its programs run before the PDL
    wait: ``moe_triton.SHARED_BEFORE_WAIT``), the routing weights' last column 1."""
    from bench.quantised_experts import kimi_quantised_experts
    from k3serve.model.moe import GLUMLP

    cfg, ex = kimi_quantised_experts(gen, E)
    if shared:
        mlp = GLUMLP(cfg, cfg.hidden_size, ex.intermediate, torch.bfloat16, DEV)
        for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            m.weight.data = (torch.randn(m.weight.shape, device=DEV, generator=gen) * m.weight.shape[1] ** -0.5).bfloat16()
        assert ex.join_shared(mlp) and ex.num_shared == 1
    assert ex.use_mma_layout() and ex.folded_scales
    x = torch.randn(T, cfg.hidden_size, device=DEV, generator=gen).bfloat16()
    ids = torch.rand(T, E, device=DEV, generator=gen).topk(top - shared, dim=-1).indices
    weights = torch.rand(T, top - shared, device=DEV, generator=gen)
    if shared:
        ids = torch.cat([ids, torch.full((T, 1), E, device=DEV, dtype=ids.dtype)], 1)
        weights = torch.cat([weights, torch.ones(T, 1, device=DEV)], 1)
    ref = torch.zeros(T, cfg.hidden_size, dtype=torch.float64, device=DEV)
    for t in range(T):
        for j in range(top):
            w1, w2, w3 = (w.double() for w in ex.expert(int(ids[t, j])))
            h = (F.silu(w1 @ x[t].double()) * (w3 @ x[t].double())).bfloat16().double()
            ref[t] += weights[t, j].double() * (w2 @ h)
    outs = []
    for per_sm in (moe_triton.GLUON_SPLIT_K_PER_SM, 0):
        with constants(f"k3serve.ops.moe_triton.GLUON_SPLIT_K_PER_SM={per_sm}"):
            splits = [moe_triton.gluon_split_k(T * top, n, k, torch.device(DEV)) for n, k in
                      ((ex.intermediate, cfg.hidden_size), (cfg.hidden_size, ex.intermediate))] if per_sm else [1, 1]
            outs.append(moe_triton.experts_triton(x, weights, ids, ex))
        record("MXFP4 experts quantised at load, Gluon" + (", split K" if per_sm else "")
               + (", shared joined" if shared else ""),
               f"T={T} E={E} top {top} d={cfg.hidden_size} I={ex.intermediate} splits gate/up {splits[0]}, down {splits[1]}",
               rel(outs[-1], ref), 1e-3)
    record("MXFP4 experts quantised at load, split K vs unsplit" + (", shared joined" if shared else ""), f"T={T}",
           rel(outs[0], outs[1].double()), 1e-3)
    with constants(GLUON_NEXT):  # the forms not served yet: the same sums, so the same bits
        new = moe_triton.experts_triton(x, weights, ids, ex)
    record("MXFP4 experts, split K, " + GLUON_NEXT + " vs served" + (", shared joined" if shared else ""), f"T={T}",
           float((new != outs[0]).sum()), 0)


def check_bf16_grouped(T: int, E: int, N: int, K: int, top: int, gen: torch.Generator, block_m: int = 16) -> None:
    """bf16 experts (kimi-linear's) through every bf16 tile of the grouped GEMM: gate / up with the
    SiLU-GLU epilogue, and a plain GEMM with the routing weights on its rows (the down projection),
    against float64 of the same bf16 values. Row blocks past 16 (prefill's): the prefill tiles and
    the one they compete with; a tile whose shared memory does not fit is skipped, as the autotuner does."""
    w, w_up = ((torch.randn(E, N, K, generator=gen, device=DEV) * K ** -0.5).bfloat16() for _ in range(2))
    ids = torch.rand(T, E, device=DEV, generator=gen).topk(top, dim=-1).indices
    x = torch.randn(T, K, device=DEV, generator=gen).bfloat16()
    row_scale = torch.rand(T * top, device=DEV, generator=gen) + 0.5
    rows, blocks = sort_by_expert(ids, E, block_m)
    xa, a = x.double()[torch.arange(T * top, device=DEV) // top], ids.flatten()
    gate = torch.einsum("ak,ank->an", xa, w.double()[a])
    exact = {False: gate * row_scale.double()[:, None],
             True: F.silu(gate) * torch.einsum("ak,ank->an", xa, w_up.double()[a])}
    # the autotuner's tiles (K tiles of 64), then wider K tiles (moe_triton.PINNED's fifth entry)
    k_tiles = [(32, True, 2, 3, 128), (64, True, 4, 3, 128), (64, False, 4, 3, 128), (32, True, 2, 4, 128),
               (128, False, 4, 4, 128), (32, True, 4, 3, 256), (16, True, 2, 4, 256), (64, True, 4, 3, 256)]
    tiles = sorted(moe_triton._TILES | moe_triton._PREFILL_TILES) + k_tiles if block_m == 16 else \
        sorted(moe_triton._PREFILL_TILES | {(128, False, 8, 3)})
    for tile in tiles:
        for glu in (False, True):
            out = torch.empty(T * top, N, device=DEV)
            try:
                grouped_gemm(x, rows, blocks, T * top, top, w, None, N, block_m, up=(w_up, None) if glu else None,
                             row_scale=None if glu else row_scale, out=out,
                             tiles=dict(zip(("BLOCK_N", "SWAP_AB", "num_warps", "num_stages", "BLOCK_K"), tile)))
            except triton.runtime.errors.OutOfResources:
                continue
            record("bf16 grouped GEMM" + (" + GLU" if glu else " + row scale"),
                   f"T={T} E={E} N={N} K={K} rows {block_m} tile {tile[0]}{'s' if tile[1] else ''}/{tile[2]}w/"
                   f"{tile[3]}s" + (f"/k{tile[4]}" if len(tile) > 4 else ""), rel(out, exact[glu]), 1e-4)


def mla_prefill_checks(gen: torch.Generator) -> None:
    for tma in (False, True):  # the served loads, and TMA's (``TMA_LOADS``)
        for Ha, ctx, Tq in ((32, 0, 2048), (32, 700, 300), (96, 0, 37), (96, 6000, 2100)):
            check_mla_prefill(Ha, ctx, Tq, gen, tma=tma)
        check_mla_prefill_varlen(32, [(0, 512), (700, 300), (0, 1), (64, 2048), (5, 37)], gen, tma=tma)
    for ctx, Tq in ((0, 2048), (700, 300), (6000, 1)):
        check_mla_prefill(32, ctx, Tq, gen, sdpa=True)


def bf16_grouped_checks(gen: torch.Generator) -> None:
    for T, N, K in ((1, 1024, 2304), (1, 2304, 1024), (16, 2304, 1024)):  # kimi-linear's gate / up and down
        check_bf16_grouped(T, 64, N, K, 9, gen)
    for N, K in ((1024, 2304), (2304, 1024)):  # prefill row blocks: ~300 rows an expert
        check_bf16_grouped(600, 16, N, K, 8, gen, block_m=128)


def gluon_checks(family: str, gen: torch.Generator) -> None:
    """The Gluon kernels' rows, by family (``--gluon FAMILY`` runs one alone: a kernel that faults
    takes only its own process down)."""
    if family == "mla":
        check_mla_decode(1, 32, [4096], gen, gluon=True)
        check_mla_decode(16, 96, [32768] + [1000 * i + 1 for i in range(15)], gen, gluon=True)
        check_mla_decode(3, 16, [1, 64, 129], gen, gluon=True)  # one key, one whole page, a page and a key
        check_mla_decode(1, 32, [300], gen, gluon=True, width=16384)  # a 1M-token table: 64 splits, 59 empty
        check_mla_decode(4, 32, [1, 700, 64, 5000], gen, gluon=True, width=16384)
        # heads-major (from HEADS_MAJOR_MIN heads): padded head blocks, one key, empty splits
        check_mla_decode(3, 64, [1, 64, 129], gen, gluon=True)
        check_mla_decode(2, 80, [1, 5000], gen, gluon=True, width=16384)
        check_mla_decode(2, 128, [4096, 777], gen, gluon=True)
        with constants("k3serve.ops.mla_decode_gluon.HEADS_MAJOR_MIN=None"):  # K3's 96 heads keys-major
            check_mla_decode(16, 96, [32768] + [1000 * i + 1 for i in range(15)], gen, gluon=True)
        # the seesaw schedule (tiles in pairs: 1 and 3 tiles leave the second of a pair empty)
        with constants(f"k3serve.ops.mla_decode_gluon.SEESAW={not mla_decode_gluon.SEESAW}"):
            check_mla_decode(3, 64, [1, 64, 129], gen, gluon=True)
            check_mla_decode(2, 80, [1, 5000], gen, gluon=True, width=16384)
            check_mla_decode(2, 128, [4096, 777], gen, gluon=True)
            check_mla_decode(16, 96, [32768] + [1000 * i + 1 for i in range(15)], gen, gluon=True)
        # the seesaw ring's other copy form (served: TMA from a producer warp, rows past the keys zeroed in shared
        # memory; else each warpgroup's cp.async), then NaN in the rows outside the keys, served forms
        with constants(f"k3serve.ops.mla_decode_gluon.SEESAW=True,"
                       f"k3serve.ops.mla_decode_gluon.SEESAW_TMA={not mla_decode_gluon.SEESAW_TMA}"):
            check_mla_decode(3, 64, [1, 64, 129], gen, gluon=True)
            check_mla_decode(2, 80, [1, 5000], gen, gluon=True, width=16384)
            check_mla_decode(2, 128, [4096, 777], gen, gluon=True)
            check_mla_decode(16, 96, [32768] + [1000 * i + 1 for i in range(15)], gen, gluon=True)
            check_mla_decode(5, 96, [1, 64, 129, 5000, 4097], gen, gluon=True, poison=True)
        check_mla_decode(5, 96, [1, 64, 129, 5000, 4097], gen, gluon=True, poison=True)
        check_mla_decode(3, 32, [1, 65, 4097], gen, gluon=True, poison=True)
        # head blocks fastest in the launch order (both heads-major forms; keys-major at 96 heads: 3 blocks)
        flip = f"k3serve.ops.mla_decode_gluon.HEAD_BLOCKS_FIRST={not mla_decode_gluon.HEAD_BLOCKS_FIRST}"
        for forms in ("SEESAW=True", "SEESAW=False", "HEADS_MAJOR_MIN=None"):
            with constants(flip + f",k3serve.ops.mla_decode_gluon.{forms}"):
                check_mla_decode(2, 128, [4096, 777], gen, gluon=True)
                check_mla_decode(5, 96, [1, 64, 129, 5000, 32768], gen, gluon=True, width=16384)
    elif family == "kda":
        for N, H, lb in ((1, 32, -5.0), (5, 96, None), (64, 32, -5.0), (300, 96, -5.0)):
            check_kda_fused(N, H, 128, lb, gen, gluon=True)
    elif family == "moe":
        for T, E, N, K, top in ((1, 64, 3072, 3584, 16), (16, 64, 3584, 3072, 16), (200, 32, 1024, 2304, 8)):
            check_mxfp4_mma(T, E, N, K, top, gen, "gluon")
        check_mxfp4_mma(300, 8, 1024, 2304, 4, gen, "gluon", block_m=128)  # prefill row blocks: ~150 rows an expert
        check_mxfp4_mma(16, 64, 3584, 3072, 16, gen, "gluon", block_m=8)  # row blocks of 8 (wgmma N = 8)
        check_mxfp4_mma(300, 8, 1024, 2304, 4, gen, "gluon", block_m=(32, 64, 128))  # mixed sizes: 1 x 128 + a tail
        check_mxfp4_mma(700, 16, 1024, 2304, 4, gen, "gluon", block_m=(16, 32, 64, 128))
        for T in (1, 2, 3, 4):  # split K: 6 / 2, 3 / 1, 2 / 1, 1 / 1 (gate / up, down)
            check_experts_split(T, gen)
        for T in (1, 2):  # the shared expert joined: at one token its programs run before the PDL wait
            check_experts_split(T, gen, shared=True)
        with constants(GLUON_NEXT):  # every unsplit form again, as it would be served
            print(f"| (the rows below: {GLUON_NEXT}) | | | | |")
            for T, E, N, K, top in ((1, 64, 3072, 3584, 16), (16, 64, 3584, 3072, 16), (200, 32, 1024, 2304, 8)):
                check_mxfp4_mma(T, E, N, K, top, gen, "gluon")
            check_mxfp4_mma(16, 64, 3584, 3072, 16, gen, "gluon", block_m=8)
            check_mxfp4_mma(700, 16, 1024, 2304, 4, gen, "gluon", block_m=(16, 32, 64, 128))
    else:
        raise SystemExit(f"--gluon {family!r}: mla, kda or moe")


def main() -> int:
    """Every check; ``--no-gluon``: all but the Gluon kernels' rows; ``--gluon FAMILY``: one
    family of those alone; ``--copy-staged``: the step boundary's staged-input copy alone;
    ``--mla-decode``: the MLA decode rows alone, Triton and Gluon; ``--norms``: the layer
    boundary's norms alone."""
    from bench import check_attn_res

    gen = torch.Generator(device=DEV).manual_seed(0)
    print(torch.cuda.get_device_name(), "\n| check | shape | rel err | tol | |\n|---|---|---|---|---|")
    args = sys.argv[1:]
    if "--gluon" in args:
        gluon_checks(args[args.index("--gluon") + 1], gen)
        return report()
    if "--kda-fused" in args:
        for N, H, lb in KDA_FUSED_SHAPES:
            check_kda_fused(N, H, 128, lb, gen)
        return report()
    if "--sampling" in args:
        for S in (1, 3, 16, 64, 256):
            check_sampling(S, 163840, gen)
            check_sampling(S, 163840, gen, peaked=True)
        return report()
    if "--copy-staged" in args:
        copy_staged_checks()
        return report()
    if "--norms" in args:
        norm_checks(gen)
        return report()
    if "--mla-prefill" in args:
        mla_prefill_checks(gen)
        return report()
    if "--moe-bf16" in args:
        bf16_grouped_checks(gen)
        return report()
    if "--mla-decode" in args:
        check_mla_decode(1, 32, [4096], gen)
        check_mla_decode(2, 32, [300, 1], gen, width=16384)
        gluon_checks("mla", gen)
        return report()
    check_short_convs(gen)
    if "--short-conv" in args:
        return report()
    norm_checks(gen)
    for T in (1, 64, 8192):
        check_combine(T, 8, 2304, False, gen)  # kimi-linear: shared experts added
    for T in (1, 16, 300):
        check_combine(T, 16, 3584, True, gen)  # K3 latent: the latent norm (14 column blocks a row)
    check_attn_res.run(check_attn_res_partial, gen)  # (split between programs and not)
    check_attn_res.run_summaries(check_attn_res_summary, gen)
    mla_prefill_checks(gen)
    check_mla_decode(1, 32, [4096], gen)
    check_mla_decode(2, 32, [300, 1], gen, width=16384)
    for T, E, D, K in ((1, 256, 2304, 8), (3, 896, 7168, 16), (64, 256, 2304, 8), (16, 896, 7168, 16),
                       (8192, 256, 2304, 8), (2048, 896, 7168, 16)):  # (prefill sizes: cuBLAS's fp32 GEMM)
        check_router(T, E, D, K, gen)
    for flag, tol in (("ROUTER_PREFILL_MMA", 3e-5), ("ROUTER_PREFILL_KERNEL", 1e-6)):
        check_router_prefill(8192, 256, 2304, flag, tol, gen)
        check_router_prefill(2048, 896, 7168, flag, tol, gen)
    check_mla_decode(16, 96, [32768] + [1000 * i + 1 for i in range(15)], gen)
    for T, K, N in ((1, 2304, 12576), (3, 4096, 2304), (4, 2304, 6144), (16, 9216, 2304), (1, 128, 4096),
                    (2, 512, 512)):
        check_gemv(T, K, N, gen)
    for T, E, top, sizes in ((8192, 896, 16, (16, 32, 64, 128)), (8192, 256, 8, (128,)), (700, 64, 8, (64,))):
        check_expert_sort(T, E, top, sizes, gen)
    copy_staged_checks()
    for B, T, K, N, fp32_x in ((2, 1, 128, 4096, False), (2, 4, 128, 4096, False), (32, 1, 128, 512, False),
                               (32, 3, 512, 128, True), (64, 1, 512, 128, True)):
        check_gemv_batched(B, T, K, N, fp32_x, gen)
    for N, H, lb in KDA_FUSED_SHAPES:
        check_kda_fused(N, H, 128, lb, gen)
    for T, E, N, K, top in ((1, 64, 3072, 3584, 16), (16, 64, 3584, 3072, 16), (200, 32, 1024, 2304, 8)):
        check_mxfp4_mma(T, E, N, K, top, gen, "mma")
    bf16_grouped_checks(gen)
    if "--no-gluon" not in args:
        for family in ("moe", "kda", "mla"):
            gluon_checks(family, gen)
    return report()


def report() -> int:
    failed = [r for r in ROWS if r[2] > r[3]]
    print(f"{len(ROWS) - len(failed)} of {len(ROWS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

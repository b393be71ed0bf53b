"""The small fused decode-path kernels on the GPU ([gpu-kernels]; not a CI test): RMSNorm, residual
add + RMSNorm, the GLU activation, MoE routing and expert alignment, the AttnRes mixer, each
checked against its torch form on fresh random inputs and timed next to it at decode sizes. They
are launch- and latency-bound: the figure that matters is microseconds per call (one launch
instead of ~6 / ~10 / ~7 / ~20), with bytes / copy ceiling shown for the norms and the mixer.

Usage: python -m bench.kernels_small [--set module.CONST=value,...] [--route-warps | --attn-res [OLD_KERNEL_FILE]]
  --route-warps: only the route kernel at each warp count
  --attn-res: only the AttnRes mixer at K3's width (bytes / copy ceiling, the torch form beside it;
              OLD_KERNEL_FILE: another attn_res_triton.py timed in a third column, for an A/B)
"""

from __future__ import annotations

import sys

import torch

from bench.ceilings import copy_tbs
from bench.summary import Row
from bench.timing import gpu_ms
from k3serve.model.layers import RMSNorm, glu_activation, rms_norm
from k3serve.ops.glu_triton import glu_triton
from k3serve.ops.moe_ref import route
from k3serve.ops.expert_sort import sort_by_expert, sort_by_expert_torch
from k3serve.ops.moe_triton import route_triton
from k3serve.ops.norm_triton import add_rms_norm_triton, rms_norm_triton


def _us(fn) -> float:
    return 1e3 * gpu_ms(fn, rep=200)


def alignment_check(ids, rows, blocks, ref_blocks) -> str:
    """What the grouped GEMM needs of the layout, each property on its own (the row order inside
    an expert's segment follows the atomics and may differ from the torch form's stable order)."""
    flat, n = ids.flatten(), ids.numel()
    real = rows[rows < n]
    once = torch.equal(real.sort().values, torch.arange(n, device=ids.device))
    row_expert = blocks.repeat_interleave(16)
    own = bool((flat[real] == row_expert[rows < n]).all())
    return f"each assignment once: {once}, in a block of its expert: {own}, block experts as torch: {torch.equal(blocks, ref_blocks)}"


def main() -> list[Row]:
    """The norms, GLU, routing and alignment, then the AttnRes mixer (``attn_res``), each beside its
    torch form; returns their rows for ``bench.kernels``' one table."""
    copy = copy_tbs()
    summary = []
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"copy {copy:.2f} TB/s\n")
    print("| op | shape | ours us | torch us | check |\n|---|---|---|---|---|")
    for T, D in ((1, 2304), (64, 2304), (1, 7168), (256, 7168), (8192, 2304), (8192 * 32, 128)):
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        d = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        norm = RMSNorm(D, 1e-5, torch.bfloat16, "cuda")
        norm.weight.data.uniform_(0.5, 1.5, generator=g)
        with torch.inference_mode():
            err = ((rms_norm_triton(x, norm.weight, 1e-5).float() - rms_norm(x, norm.weight, 1e-5, torch.float32)).norm()
                   / rms_norm(x, norm.weight, 1e-5, torch.float32).norm()).item()
            t_ours = _us(lambda: rms_norm_triton(x, norm.weight, 1e-5))
            t_ref = _us(lambda: (lambda xf: (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
                                             * norm.weight.float()).bfloat16())(x.float()))
            gb = 2 * x.numel() * 2 / 1e9
            print(f"| rms_norm | {T}x{D} | {t_ours:.1f} ({gb / t_ours * 1e6 / 1e3 / copy * 100:.0f} % copy) | "
                  f"{t_ref:.1f} | rel err {err:.1e} |")
            summary.append(Row("RMSNorm (Triton)", f"{T} x {D}", t_ours / 1e3, gb * 1e9, "copy", "torch", t_ref / 1e3,
                            f"rel err {err:.1e}"))
            h_out, y = add_rms_norm_triton(x, d, norm.weight, 1e-5)
            same = torch.equal(h_out, x + d)
            t_ours = _us(lambda: add_rms_norm_triton(x, d, norm.weight, 1e-5))
            t_ref = _us(lambda: norm(x + d))
            print(f"| add + rms_norm | {T}x{D} | {t_ours:.1f} | {t_ref:.1f} | residual bit-equal: {same} |")
            summary.append(Row("residual add + RMSNorm (Triton)", f"{T} x {D}", t_ours / 1e3, 2 * gb * 1e9, "copy", "torch",
                            t_ref / 1e3, f"residual bit-equal: {same}"))
    # GLU of the shared experts / dense MLPs: Kimi-Linear SiLU (1024 wide), K3 SiTU (2 x 3072 shared, 33792 dense)
    for T, n, act, beta, lb in ((1, 1024, "silu", 1.0, None), (1, 6144, "situ", 4.0, 25.0),
                                (1, 33792, "situ", 4.0, 25.0), (64, 6144, "situ", 4.0, 25.0),
                                (8192, 1024, "silu", 1.0, None)):
        fused = torch.randn(T, 2 * n, device="cuda", generator=g).bfloat16() * 3
        gate, up = fused[:, :n], fused[:, n:]
        ref = glu_activation(gate.float(), up.float(), act, beta, lb)
        err = ((glu_triton(gate, up, act, beta, lb).float() - ref).norm() / ref.norm()).item()
        t_ours = _us(lambda: glu_triton(gate, up, act, beta, lb))
        t_ref = _us(lambda: glu_activation(gate, up, act, beta, lb))
        print(f"| {act}-GLU | {T}x{n} | {t_ours:.1f} | {t_ref:.1f} | rel err {err:.1e} |")
        summary.append(Row(f"{act}-GLU (Triton)", f"{T} x {n}", t_ours / 1e3, 3 * T * n * 2, "copy", "torch", t_ref / 1e3,
                        f"rel err {err:.1e}"))
    for T, E, K, scaling in ((1, 256, 8, 2.446), (64, 256, 8, 2.446), (512, 256, 8, 2.446), (8192, 256, 8, 2.446),
                             (1, 896, 16, 2.5), (256, 896, 16, 2.5)):
        logits = torch.randn(T, E, device="cuda", generator=g) * 2
        bias = torch.randn(E, device="cuda", generator=g) * 0.3
        w_ref, ids_ref = route(logits, bias, K, 1, 1, True, scaling)
        w, ids = route_triton(logits, bias, K, True, scaling)
        ok = torch.equal(ids, ids_ref) and torch.allclose(w, w_ref, rtol=1e-5, atol=1e-6)
        t_ours = _us(lambda: route_triton(logits, bias, K, True, scaling))
        t_ref = _us(lambda: route(logits, bias, K, 1, 1, True, scaling))
        print(f"| route | {T} tokens, {E} experts, top-{K} | {t_ours:.1f} | {t_ref:.1f} | same experts + weights: {ok} |")
        summary.append(Row("route (Triton)", f"{T} tokens, top-{K} of {E}", t_ours / 1e3, ref="torch", ref_ms=t_ref / 1e3,
                        check=f"same experts + weights: {ok}"))
        rows, blocks = sort_by_expert(ids, E, 16)
        check = alignment_check(ids, rows, blocks, sort_by_expert_torch(ids, E, 16)[1])
        t_ours = _us(lambda: sort_by_expert(ids, E, 16))
        t_ref = _us(lambda: sort_by_expert_torch(ids, E, 16))
        print(f"| expert alignment | {T * K} assignments, {E} experts | {t_ours:.1f} | {t_ref:.1f} | {check} |")
        summary.append(Row("expert alignment (Triton)", f"{T * K} assignments, {E} experts", t_ours / 1e3, ref="torch",
                        ref_ms=t_ref / 1e3, check=check))
    print()
    return summary + attn_res(None)


def route_warps() -> None:
    """The route kernel as a decode step calls it (partial logits of 18 / 28 chunks of D) at each
    ``moe_triton.ROUTE_WARPS``: the same experts and weights, and the time."""
    from k3serve.ops import moe_triton

    saved = moe_triton.ROUTE_WARPS
    g = torch.Generator(device="cuda").manual_seed(0)
    print("| route, warps | tokens, experts, top-k, partial sums | us | same as 4 warps |\n|---|---|---|---|")
    for T, E, K, parts in ((1, 256, 8, 18), (4, 256, 8, 18), (64, 256, 8, 18), (1, 896, 16, 28)):
        logits = torch.randn(parts, T, E, device="cuda", generator=g) * 0.5
        bias = torch.randn(E, device="cuda", generator=g) * 0.3
        moe_triton.ROUTE_WARPS = 4
        ref = route_triton(logits, bias, K, True, 2.5, num_shared=1)
        for warps in (1, 2, 4, 8):
            moe_triton.ROUTE_WARPS = warps
            out = route_triton(logits, bias, K, True, 2.5, num_shared=1)
            same = torch.equal(out[1], ref[1]) and torch.allclose(out[0], ref[0], rtol=1e-6, atol=0)
            t = _us(lambda: route_triton(logits, bias, K, True, 2.5, num_shared=1))
            print(f"| {warps} | {T}, {E}, {K}, {parts} | {t:.1f} | {same} |", flush=True)
    moe_triton.ROUTE_WARPS = saved


def mixer_source_counts(num_layers: int, block_size: int) -> list[int]:
    """How many sources each AttnRes mixer of a forward pass reads (token and channel mixer of every
    layer, then the final one), from the model's own bookkeeping (``AttnResState``) on CPU."""
    from k3serve.model.attn_res import AttnResState

    res = AttnResState(torch.zeros(1, 1), block_size, num_layers, use_buffer=True, defer=False)
    counts, out = [], torch.zeros(1, 1)
    for layer in range(num_layers):
        counts.append(len(res.token_mixer_sources(layer, out if layer else None)))
        counts.append(len(res.channel_mixer_sources(layer, out)))
    return counts + [len(res.final_sources(out))]


def attn_res(old_file: str | None) -> list[Row]:
    """The fused AttnRes mixer at K3's width (7,168) over 2 / 5 / 9 / 16 sources (K3's mixers read 1
    to 9) next to the torch form (mixer + RMSNorm) and, given a file, another version of the kernel
    module; bytes: every source row read once, the bf16 output written. Then the sum over K3's 187
    mixers, each at its own source count, a step and a layer: each mixer over its sources, and as
    served (a block summary at each block start from SUMMARY_MIN_BLOCKS blocks, where the tokens
    allow one, then the block's mixers over their summary row and the partial). Returns the first
    table's rows."""
    import importlib.util

    from k3serve.model.attn_res import SUMMARY_MIN_BLOCKS, AttnResMixer
    from k3serve.ops.attn_res_triton import attn_res_mix, attn_res_summary, summary_shape

    old = None
    if old_file:
        spec = importlib.util.spec_from_file_location("k3serve.ops._attn_res_old", old_file)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    copy = copy_tbs()
    g = torch.Generator(device="cuda").manual_seed(0)
    D = 7168
    summary = []
    print(f"copy {copy:.2f} TB/s\n\n| AttnRes mix | sources x tokens x D | ours us (% copy) | torch us | other file us "
          f"| rel err vs fp32 | other file rel err |\n|---|---|---|---|---|---|---|")
    for M, T in ((2, 1), (5, 1), (6, 1), (9, 1), (16, 1), (9, 2), (9, 4), (9, 16), (9, 64), (9, 256), (9, 4096)):
        mixer = AttnResMixer(D, 1e-6, torch.float32, "cuda")
        mixer.proj.data.copy_(torch.randn(1, D, device="cuda", generator=g))
        mixer.norm.data.uniform_(0.5, 1.5, generator=g)
        out_w = torch.rand(D, device="cuda", generator=g) + 0.5
        src = torch.randn(M, T, D, device="cuda", generator=g).bfloat16()
        with torch.inference_mode():
            q = mixer.folded_query()
            ref = rms_norm(mixer(list(src.float())), out_w, 1e-6, torch.float32)

            def err(out):
                return ((out.float() - ref).norm() / ref.norm()).item()

            ours = lambda: attn_res_mix(src, q, 1e-6, out_w.bfloat16(), torch.bfloat16)  # noqa: E731
            t_ours = _us(ours)
            mixer_bf16 = AttnResMixer(D, 1e-6, torch.bfloat16, "cuda")
            mixer_bf16.load_state_dict(mixer.state_dict())
            t_ref = _us(lambda: rms_norm(mixer_bf16(list(src)), out_w.bfloat16(), 1e-6, torch.bfloat16))
            other = lambda: old.attn_res_mix(src, q, 1e-6, out_w.bfloat16(), torch.bfloat16)  # noqa: E731
            t_old, e_old = (f"{_us(other):.1f}", f"{err(other()):.1e}") if old else ("-", "-")
            gb = (M + 1) * T * D * 2 / 1e9
            print(f"| {M} x {T} x {D} | {t_ours:.1f} ({gb / t_ours * 1e3 / copy * 100:.0f} %) | {t_ref:.1f} | {t_old} "
                  f"| {err(ours()):.1e} | {e_old} |", flush=True)
            summary.append(Row("AttnRes mixer + RMSNorm (Triton)", f"{M} sources x {T} x {D}", t_ours / 1e3, gb * 1e9,
                            "copy", "torch", t_ref / 1e3, f"rel err vs fp32 {err(ours()):.1e}"))
    # the whole K3 (93 layers, blocks of 12): every mixer at its own source count
    counts = mixer_source_counts(93, 12)
    q, out_w = torch.randn(D, device="cuda", generator=g), torch.rand(D, device="cuda", generator=g).bfloat16() + 0.5
    print(f"\n| K3's {len(counts)} mixers, tokens | us a step | us a layer, mean | layers 0-47 / 48-92 | served "
          f"(summaries) us a step | a layer | layers 0-47 / 48-92 |\n|---|---|---|---|---|---|---|")
    for T in (1, 4, 16, 64):
        us = {}
        for M in sorted(set(counts)):
            src = torch.randn(M, T, D, device="cuda", generator=g).bfloat16()
            us[M] = _us(lambda: attn_res_mix(src, q, 1e-5, out_w, torch.bfloat16))
        partial = torch.randn(1, T, D, device="cuda", generator=g).bfloat16()
        served, summaries = [], {}
        for start in range(0, 93, 12):  # a block: its mixers' source counts (with the final mixer in the last)
            block = counts[2 * start: 2 * min(start + 12, 93)] + ([counts[-1]] if start + 12 >= 93 else [])
            M, Q = block[0], len(block)
            if M < SUMMARY_MIN_BLOCKS or summary_shape(M, Q, D, T, partial.device) is None:
                served += [us[m] for m in block]
                continue
            if (M, Q) not in summaries:
                src = torch.randn(M, T, D, device="cuda", generator=g).bfloat16()
                queries = torch.randn(Q, D, device="cuda", generator=g)
                rows = torch.empty(Q, T, 2, D, dtype=torch.bfloat16, device="cuda")
                logits = torch.empty(Q, T, device="cuda")
                summaries[M, Q] = _us(lambda: attn_res_summary(src, queries, 1e-5, out_w, torch.bfloat16, None, rows,
                                                               logits))
                summaries["mix"] = _us(lambda: attn_res_mix(partial, q, 1e-5, out_w, torch.bfloat16, None,
                                                            (rows[1], logits[1])))
            served += [summaries[M, Q]] + [summaries["mix"]] * (Q - 1)
        cells = []
        for per_mixer in ([us[M] for M in counts], served):
            cells += [f"{sum(per_mixer):.0f}", f"{sum(per_mixer) / 93:.1f}",
                      f"{sum(per_mixer[:96]) / 48:.1f} / {sum(per_mixer[96:-1]) / 45:.1f}"]
        print(f"| {T} | " + " | ".join(cells) + " |", flush=True)
    return summary


if __name__ == "__main__":
    if "--set" in sys.argv:
        from bench.overrides import set_constants

        print("set:", set_constants(sys.argv.pop(sys.argv.index("--set") + 1)))
        sys.argv.remove("--set")
    if "--attn-res" in sys.argv:
        rest = sys.argv[sys.argv.index("--attn-res") + 1:]
        attn_res(rest[0] if rest else None)
        sys.exit(0)
    if "--route-warps" in sys.argv:
        route_warps()
        sys.exit(0)
    main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")

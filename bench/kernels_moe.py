"""Routed-expert kernel check + timing on the GPU ([gpu-kernels] item 3; not a CI test).

The Triton grouped GEMM (MXFP4 dequantised in registers, and bf16) against the plain-torch
per-expert reference on fresh random routing, then timed on K3's latent experts (896 experts,
top-16, width 3584, intermediate 3072): decode 1..64 tokens as TB/s on the expert bytes actually
read (targets >= 60 % of copy), prefill 8K tokens as TFLOP/s (target >= 50 % of the bf16 matmul
ceiling), each next to the reference loop and with both ceilings measured in the same run.

Usage: python bench/kernels_moe.py
"""

import torch
import triton

from bench.ceilings import copy_tbs, matmul_tflops

from k3serve.model.loader import load_model
from k3serve.ops.moe_ref import experts_ref
from k3serve.ops.moe_triton import experts_triton


def main():
    copy, mm = copy_tbs(), matmul_tflops()
    print(f"copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s")
    model = load_model(preset="k3-slice", device="cuda", dtype="bfloat16", seed=0)
    moe = model.model.layers[1].block_sparse_moe
    ex = moe.experts
    d = model.config.hidden_size
    print("| tokens | experts hit | ours ms | ref ms | rel err | expert GB read | TB/s | % copy | TFLOP/s | % matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for T in (1, 16, 64, 8192):
        g = torch.Generator(device="cuda").manual_seed(T)
        xin = torch.randn(T, d, device="cuda", generator=g).bfloat16()
        w, ids = moe.gate(xin)
        z = moe.routed_expert_down_proj(xin)
        ours = lambda: experts_triton(z, w, ids, ex)  # noqa: E731
        ref = lambda: experts_ref(z, w, ids, ex.expert, *ex.act)  # noqa: E731
        err = ((ours() - ref()).norm() / ref().norm()).item() if T <= 64 else float("nan")
        t_ours = triton.testing.do_bench(ours, warmup=10, rep=100, return_mode="median")
        t_ref = triton.testing.do_bench(ref, warmup=3, rep=20, return_mode="median") if T <= 64 else float("nan")
        hit = int(torch.unique(ids).numel())
        per_expert = 3 * ex.intermediate * ex.out_features * (17 / 32 if ex.mxfp4 else 2)
        gbytes = hit * per_expert / 1e9
        flops = 2 * 3 * ids.numel() * ex.intermediate * ex.out_features
        print(f"| {T} | {hit} | {t_ours:.3f} | {t_ref:.3f} | {err:.2e} | {gbytes:.2f} | {gbytes / t_ours:.2f} | "
              f"{100 * gbytes / t_ours / copy:.0f} % | {flops / t_ours / 1e9:.0f} | {100 * flops / t_ours / 1e9 / mm:.0f} % |")


if __name__ == "__main__":
    main()

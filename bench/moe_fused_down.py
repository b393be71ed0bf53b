"""A one-token MoE layer with the down projection fused into the gate/up kernel, against the
served form (gate/up grouped GEMM, down grouped GEMM, combine: ``moe_triton.experts_triton``).

At batch 1 a kimi-linear-48b MoE layer streams 127 MB of bf16 experts (9 with the joined shared
one) in two grouped GEMMs with one dependency between them (~1 us, bench/hop_cost.py) and each
GEMM's own ramp and tail (together ~0.2 ms a step above the bytes' time, RESULTS.md twenty-second
session). Here program (assignment a, block nb of the intermediate) computes its BLOCK_I values of
h = glu(W1 x, W3 x), rounded as the served h, and at once their share of the down projection,
w_a * W2[:, block] h[block] (split-K over the intermediate), into a partial row; the combine adds a
token's A x I / BLOCK_I partial rows in a fixed order (deterministic). No dependency and no second
ramp between gate/up and down; the price: partial rows (A x I / BLOCK_I x D fp32, 1.3 MB at
BLOCK_I = 64) for the combine to read.

    python3 -m bench.moe_fused_down [--layers 26] [--experts 16]   (H200: checked, then timed in a graph)
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from k3serve.ops import pdl
from k3serve.ops.glu_triton import glu
from k3serve.ops.moe_triton import combine_experts
from k3serve.ops.pdl import pdl_start


@triton.jit
def _gate_up_down_kernel(X, W1, W3, W2, IDS, ROW_SCALE, PART, K, I, D, beta, linear_beta,
                         BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                         SITU: tl.constexpr, LINEAR_CLIP: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Program (assignment, intermediate block): h's block, then its down-projection share scaled by
    the routing weight into PART[assignment * blocks + block, :]."""
    pdl_start(USE_PDL)
    a = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(IDS + a).to(tl.int64)
    n = nb * BLOCK_I + tl.arange(0, BLOCK_I)
    nmask = n < I
    w1 = W1 + e * I * K + n[:, None].to(tl.int64) * K
    w3 = W3 + e * I * K + n[:, None].to(tl.int64) * K
    gate = tl.zeros([BLOCK_I], tl.float32)
    up = tl.zeros([BLOCK_I], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        m = nmask[:, None] & (k < K)[None, :]
        x = tl.load(X + k, mask=k < K, other=0.0).to(tl.float32)[None, :]
        gate += tl.sum(tl.load(w1 + k[None, :], mask=m, other=0.0).to(tl.float32) * x, 1)
        up += tl.sum(tl.load(w3 + k[None, :], mask=m, other=0.0).to(tl.float32) * x, 1)
    h = glu(gate, up, beta, linear_beta, SITU, LINEAR_CLIP, False).to(W2.dtype.element_ty).to(tl.float32)
    h = tl.where(nmask, h, 0.0)
    scale = tl.load(ROW_SCALE + a)
    row = PART + (a * tl.num_programs(1) + nb).to(tl.int64) * D
    w2 = W2 + e * D * I + n[None, :]
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        w = tl.load(w2 + d[:, None].to(tl.int64) * I, mask=(d < D)[:, None] & nmask[None, :], other=0.0)
        tl.store(row + d, tl.sum(w.to(tl.float32) * h[None, :], 1) * scale, mask=d < D)


def moe_one_token_fused(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, act: tuple = ("silu", 1.0, None),
                        block_i: int = 64, block_k: int = 128, block_d: int = 64, num_warps: int = 4,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [1, K]; w1, w3 [E, I, K], w2 [E, D, I] (bf16 or fp32 stacks); weights, ids [1, A]:
    sum_a weights_a * W2_ids_a glu(W1 x, W3 x), fp32 sums, rounded once to ``out_dtype``."""
    E, I, K = w1.shape
    D = w2.shape[1]
    A = ids.shape[1]
    blocks = triton.cdiv(I, block_i)
    part = torch.empty(A * blocks, D, dtype=torch.float32, device=x.device)
    kind, beta, linear_beta = act
    _gate_up_down_kernel[(A, blocks)](
        x.contiguous(), w1, w3, w2, ids.reshape(-1).contiguous(), weights.float().reshape(-1).contiguous(), part,
        K, I, D, float(beta), float(linear_beta or 0.0), BLOCK_I=block_i, BLOCK_K=block_k, BLOCK_D=block_d,
        SITU=kind == "situ", LINEAR_CLIP=linear_beta is not None, num_warps=num_warps, **pdl.launch(x.device))
    return combine_experts(part, A * blocks, None, None, out_dtype)


class Stacks:
    """``layers`` one-token MoE layers of bf16 experts (gate, up [E, I, K], down [E, D, I]) as the
    served path holds them (``RoutedExperts``), each routing one token to ``top`` distinct experts."""

    def __init__(self, layers: int, experts: int, top: int, d: int, inter: int, gen: torch.Generator,
                 dev: str = "cuda"):
        from types import SimpleNamespace

        self.layers = []
        for _ in range(layers):
            w = [(torch.randn(experts, *s, generator=gen, device=dev) * s[-1] ** -0.5).bfloat16()
                 for s in ((inter, d), (inter, d), (d, inter))]
            ids = torch.randperm(experts, generator=gen, device=dev)[:top].view(1, top)
            weights = torch.rand(1, top, generator=gen, device=dev) + 0.5
            ex = SimpleNamespace(num_experts=experts, num_shared=0, intermediate=inter, out_features=d,
                                 dtype=torch.bfloat16, act=("silu", 1.0, None), mma_layout=False,
                                 folded_scales=False, stack=lambda n, w=w: ({"w1": w[0], "w3": w[1], "w2": w[2]}[n], None))
            self.layers.append((w, ids, weights, ex))
        self.x = torch.randn(1, d, generator=gen, device=dev).bfloat16()

    def served(self) -> torch.Tensor:
        from k3serve.ops.moe_triton import experts_triton

        x = self.x
        for w, ids, weights, ex in self.layers:  # each layer's input is the previous one's output
            x = experts_triton(x, weights, ids, ex, out_dtype=torch.bfloat16)
        return x

    def fused(self, **tile) -> torch.Tensor:
        x = self.x
        for w, ids, weights, _ in self.layers:
            x = moe_one_token_fused(x, w[0], w[1], w[2], weights, ids, out_dtype=torch.bfloat16, **tile)
        return x


def main() -> None:
    from .ceilings import copy_bench_setup
    from .timing import gpu_ms

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--experts", type=int, default=16, help="experts a layer's stack (9 chosen)")
    args = ap.parse_args()
    copy, _, gen = copy_bench_setup()
    st = Stacks(args.layers, args.experts, 9, 2304, 1024, gen)  # kimi-linear's widths, 8 routed + shared
    nbytes = args.layers * 9 * 3 * 2304 * 1024 * 2
    ref = st.served().float()
    print(f"{args.layers} layers of 9 experts, {nbytes / 1e6:.0f} MB a pass\n")
    print("| form | tile | rel err vs served | us a layer | % of copy |\n|---|---|---|---|---|")
    rows = [("served (2 grouped GEMMs + combine)", None)] + [
        ("fused gate/up/down + combine", dict(block_i=bi, block_k=bk, block_d=bd, num_warps=w))
        for bi, bk, bd, w in ((64, 128, 64, 4), (32, 256, 64, 4), (64, 256, 32, 8), (128, 128, 64, 8))]
    for name, tile in rows:
        fn = st.served if tile is None else (lambda tile=tile: st.fused(**tile))
        err = ((fn().float() - ref).norm() / ref.norm()).item()
        if err > 2e-2:  # wrong results are not timed
            print(f"| {name} | {tile} | {err:.1e} (wrong) | - | - |")
            continue
        ms = gpu_ms(fn, cold=False)
        print(f"| {name} | {tile or '-'} | {err:.1e} | {ms * 1e3 / args.layers:.2f} | "
              f"{nbytes / (ms * 1e-3) / 1e12 / copy * 100:.0f} |", flush=True)


if __name__ == "__main__":
    main()

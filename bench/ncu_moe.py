"""One K3 MXFP4 grouped-GEMM launch (gate + up) at a decode or prefill size, row blocks as the
model picks them (16 at decode, 64 at prefill), for Nsight Compute (where a kernel's time goes:
memory throughput, occupancy, warp stalls, pipe use), with fixed tiles so no autotuning launches
get in the way. Not a benchmark: ``bench/kernels_moe.py`` times; this explains.

Usage (device): ncu --kernel-name regex:_grouped_gemm --launch-skip 2 --launch-count 1 \\
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \\
    python3 -m bench.ncu_moe [tokens] [upcast] [BLOCK_N,warps,stages] [kimi-q]

``kimi-q``: kimi-linear's 256 experts quantised at load instead (``--quantization mxfp4``: the MMA
layout, the Gluon kernel, split over K at 1-3 tokens as served), the gate / up as the model runs it.

upcast "mma" or "gluon": the experts in the MMA layout (``moe_triton.MMA_LAYOUT``); the others read the
checkpoint layout. Default tile: 32 wide, swapped, 2 warps, 4 stages (64,4,3 for "mma"; "gluon"
keeps 64 rows and 4 warps, its stages the copy ring).
"""

import sys

import torch

from k3serve.model.loader import load_model
from k3serve.ops import moe_triton
from k3serve.ops.moe_triton import experts_triton


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    upcast = sys.argv[2] if len(sys.argv) > 2 else "dot_scaled"
    tile = sys.argv[3] if len(sys.argv) > 3 else "64,4,3" if upcast == "mma" else "32,2,4"
    bn, warps, stages = map(int, tile.split(","))
    if sys.argv[4:5] == ["kimi-q"]:
        return kimi_quantised(tokens)
    moe_triton.MMA_LAYOUT = upcast in ("mma", "gluon")
    model = load_model(preset="k3-slice", device="cuda", dtype="bfloat16", seed=0)
    moe = model.model.layers[1].block_sparse_moe
    g = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", generator=g).bfloat16()
    with torch.inference_mode():
        w, ids = moe.gate(x)
        z = moe.routed_expert_down_proj(x)
        tiles = dict(BLOCK_N=bn, SWAP_AB=True, num_warps=warps, num_stages=stages)
        for _ in range(2):  # the first call compiles (launches 1-2); the second call's gate/up GEMM is launch 3
            # (row blocks as the model picks them for an explicit upcast: 16 at decode, 64 at prefill)
            experts_triton(z, w, ids, moe.experts, block_k=128, tiles=tiles, mx_upcast=upcast)
        torch.cuda.synchronize()


def kimi_quantised(tokens: int) -> None:
    """kimi-linear's experts as ``--quantization mxfp4`` serves them (random MXFP4 codes), top 8."""
    from .quantised_experts import kimi_quantised_experts

    g = torch.Generator(device="cuda").manual_seed(tokens)
    cfg, ex = kimi_quantised_experts(g)
    assert ex.use_mma_layout() and ex.folded_scales
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    ids = torch.rand(tokens, ex.num_experts, device="cuda", generator=g).topk(cfg.num_experts_per_token, -1).indices
    w = torch.rand(tokens, cfg.num_experts_per_token, device="cuda", generator=g)
    with torch.inference_mode():
        for _ in range(2):  # (the second call's gate / up GEMM is launch 3 of the grouped GEMMs)
            experts_triton(x, w, ids, ex)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

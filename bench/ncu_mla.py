"""The Gluon MLA decode's heads-major split step (seesaw, then heads-major) at 32K context, 96 and 128
heads, in both launch orders (``mla_decode_gluon.HEAD_BLOCKS_FIRST``), one launch each between
cudaProfilerStart / Stop, for Nsight Compute: whether the head blocks of a sequence read its latent
pages from DRAM once (L2 shared) or once each, which timings cannot tell.

Usage (device): ncu --profile-from-start off --metrics dram__bytes_read.sum,lts__t_sector_hit_rate.pct,\\
    gpu__time_duration.sum python3 -m bench.ncu_mla
"""

import torch

from bench.overrides import constants
from k3serve.ops.mla_decode_triton import mla_decode, num_splits_for


def main() -> None:
    ctx, page, rkv, dr = 32768, 64, 512, 64
    cases = []
    for B, H in ((16, 96), (64, 96), (16, 128)):
        g = torch.Generator(device="cuda").manual_seed(B + H)
        pages = B * ctx // page
        latent = torch.randn(pages, page, rkv + dr, device="cuda", generator=g).bfloat16()
        table = torch.randperm(pages, device="cuda", generator=g).view(B, -1)
        seq_lens = torch.full((B,), ctx, device="cuda")
        q = torch.randn(B, H, rkv + dr, device="cuda", generator=g)
        splits = num_splits_for(B, H, ctx, latent.device, True)
        print(f"B {B} H {H}: latent {B * ctx * (rkv + dr) * 2 / 1e6:.0f} MB, {splits} splits", flush=True)
        for form in ("SEESAW=True", "SEESAW=False"):
            for first in (False, True):
                assigns = f"k3serve.ops.mla_decode_gluon.{form},k3serve.ops.mla_decode_gluon.HEAD_BLOCKS_FIRST={first}"
                cases.append((f"B {B} H {H} {form} head blocks first {first}", assigns,
                              lambda q=q, latent=latent, table=table, seq_lens=seq_lens, splits=splits: mla_decode(
                                  q, latent, table, seq_lens, rkv, 192 ** -0.5, num_splits=splits, gluon=True)))
    for _, assigns, run in cases:  # compile outside the profiled range
        with constants(assigns):
            run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, assigns, run in cases:
        print("launch:", name, flush=True)
        with constants(assigns):
            run()
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()

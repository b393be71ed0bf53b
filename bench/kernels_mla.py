"""MLA decode kernel check + timing on the GPU ([gpu-kernels] item 2; not a CI test).

Checks the Triton split-KV kernel against the plain-torch absorbed reference on fresh random
paged caches (several shapes), then times it at the issue's shape (B >= 16, 32K context, 96 heads,
576-wide bf16 latent) next to the torch einsum baseline, as achieved TB/s on the latent bytes and
the fraction of a device-to-device copy measured in the same run.

Usage: python bench/kernels_mla.py
"""

import torch
import triton

from bench.ceilings import copy_tbs

from k3serve.ops.mla_decode_triton import default_num_splits, mla_decode
from k3serve.ops.mla_ref import mla_absorbed_ref


def case(B, H, ctx, page=64, rkv=512, dr=64, splits=None, check=True):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + H)
    pages_per = -(-ctx // page)
    latent = torch.randn(B * pages_per, page, rkv + dr, device="cuda", generator=g).bfloat16()
    table = torch.randperm(B * pages_per, device="cuda", generator=g).view(B, pages_per)
    seq_lens = torch.full((B,), ctx, device="cuda")
    q = torch.randn(B, H, rkv + dr, device="cuda", generator=g)
    scale = 192 ** -0.5
    splits = splits or default_num_splits(B, H, pages_per * page, torch.cuda.get_device_properties(0).multi_processor_count)
    run = lambda: mla_decode(q, latent, table, seq_lens, rkv, scale, num_splits=splits)  # noqa: E731
    out = run()
    row = {"B": B, "H": H, "ctx": ctx, "splits": splits}
    if check:
        lat = latent[table].flatten(1, 2)[:, :ctx].float()
        mask = torch.arange(ctx, device="cuda")[None, :] < seq_lens[:, None]
        ref = mla_absorbed_ref(q.bfloat16().float()[:, None], lat, mask[:, None], rkv, scale)[:, 0]
        row["rel_err"] = ((out - ref).norm() / ref.norm()).item()
    ms = triton.testing.do_bench(run, warmup=25, rep=200, return_mode="median")
    nbytes = B * ctx * (rkv + dr) * 2
    row.update(ms=ms, tbs=nbytes / (ms * 1e-3) / 1e12)
    return row


def main():
    ceil = copy_tbs()
    print(f"copy ceiling {ceil:.2f} TB/s")
    rows = [case(2, 16, 300, check=True), case(3, 96, 1000, check=True), case(16, 96, 4096, check=True)]
    rows += [case(B, 96, 32768, check=False) for B in (16, 32, 64)]
    print("| B | heads | context | splits | time ms | latent TB/s | % of copy | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['B']} | {r['H']} | {r['ctx']} | {r['splits']} | {r['ms']:.3f} | {r['tbs']:.2f} | "
              f"{100 * r['tbs'] / ceil:.0f} % | {r.get('rel_err', float('nan')):.2e} |")


if __name__ == "__main__":
    main()

"""MLA decode kernel check + timing on the GPU ([gpu-kernels] item 2; not a CI test).

Checks the Triton split-KV kernel against the plain-torch absorbed reference on fresh random
paged caches (several shapes), then times it at the issue's shape (B >= 16, 32K context, 96 heads,
576-wide bf16 latent), as achieved TB/s on the latent bytes and the fraction of a device-to-device
copy measured in the same run, and as TFLOP/s against the bf16 matmul ceiling: with 96 heads the
absorbed decode does 2 x 96 x (576 + 512) flops per 1,152 latent bytes, ~363 flop/byte, above the
H200's ~165 flop/byte ridge, so it is compute-bound there and the copy ceiling is out of reach
whatever the kernel (at 16 heads a GPU, e.g. 96 heads over TP=6, it is memory-bound). A sweep
over head block, key tile, warps and stages at both head counts picks the autotuner's candidates.

Usage: python bench/kernels_mla.py [--no-sweep | --mem | --gluon]   (--gluon: mla_decode_gluon, checked then timed)
"""

import torch
import triton

import sys

from bench.ceilings import copy_tbs, matmul_tflops
from bench.summary import Row
from bench.timing import gpu_ms

from bench.overrides import constants
from k3serve.ops.mla_decode_triton import (_mla_decode_tuned, default_num_splits, gluon_split_applies, mla_decode,
                                           num_splits_for)
from k3serve.ops.mla_ref import mla_absorbed_ref


def case(B, H, ctx, page=64, rkv=512, dr=64, splits=None, check=True, tiles=None, gluon=False):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + H)
    pages_per = -(-ctx // page)
    latent = torch.randn(B * pages_per, page, rkv + dr, device="cuda", generator=g).bfloat16()
    table = torch.randperm(B * pages_per, device="cuda", generator=g).view(B, pages_per)
    seq_lens = torch.full((B,), ctx, device="cuda")
    q = torch.randn(B, H, rkv + dr, device="cuda", generator=g)
    scale = 192 ** -0.5
    splits = splits or num_splits_for(B, H, pages_per * page, latent.device, gluon_split_applies(latent, rkv, dr, gluon))
    run = lambda: mla_decode(q, latent, table, seq_lens, rkv, scale, num_splits=splits, tiles=tiles,  # noqa: E731
                             gluon=gluon)
    out = run()
    row = {"B": B, "H": H, "ctx": ctx, "splits": splits}
    if check:
        lat = latent[table].flatten(1, 2)[:, :ctx].float()
        mask = torch.arange(ctx, device="cuda")[None, :] < seq_lens[:, None]
        ref = mla_absorbed_ref(q.bfloat16().float()[:, None], lat, mask[:, None], rkv, scale)[:, 0]
        row["rel_err"] = ((out - ref).norm() / ref.norm()).item()
    ms = gpu_ms(run, rep=200)
    nbytes = B * ctx * (rkv + dr) * 2
    row.update(ms=ms, bytes=nbytes, tbs=nbytes / (ms * 1e-3) / 1e12,
               tflops=2 * B * H * ctx * (2 * rkv + dr) / (ms * 1e-3) / 1e12)
    c = getattr(_mla_decode_tuned, "best_config", None)
    if gluon_split_applies(latent, rkv, dr, gluon):
        row["config"] = "Gluon split step"
    elif tiles is None and c is not None:
        row["config"] = f"{c.kwargs['BLOCK_H']},{c.kwargs['BLOCK_N']},{c.num_warps},{c.num_stages}"
    return row


SWEEP = [(16, 32, 4, 2), (16, 64, 4, 3), (32, 32, 4, 2), (32, 32, 8, 2), (32, 64, 8, 2), (64, 32, 8, 2),
         (64, 64, 8, 2), (64, 32, 8, 3), (64, 16, 4, 2), (64, 32, 4, 2), (64, 64, 4, 2), (64, 128, 8, 1), (64, 64, 16, 2),
         (16, 32, 2, 3), (16, 64, 4, 2)]


# ``--mem``: head block, key tile, warps, stages at <= 32 heads, and at 96
MEM_SWEEP = [(16, 32, 4, 2), (16, 64, 4, 2), (16, 64, 4, 3), (16, 128, 4, 2), (16, 64, 8, 2), (32, 32, 4, 2),
             (32, 32, 8, 2), (32, 64, 4, 2), (32, 64, 8, 3), (32, 128, 8, 2)]
MEM_SWEEP_96 = [(64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (32, 64, 8, 2), (64, 128, 8, 1)]


def main() -> list[Row] | None:
    """Prints its tables; returns the rows as the model calls the kernel (the Gluon split step where
    ``GLUON_SPLIT``) for ``bench.kernels``' one table (None after ``--gluon`` / ``--mem``, which only sweep)."""
    ceil, mm = copy_tbs(), matmul_tflops()
    print(f"copy ceiling {ceil:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s")
    head = ("| B | heads | context | splits | tiles (BLOCK_H, BLOCK_N, warps, stages) | time ms | latent TB/s | % of copy "
            "| TFLOP/s | % of matmul | rel err |\n|---|---|---|---|---|---|---|---|---|---|---|")

    def show(r):
        print(f"| {r['B']} | {r['H']} | {r['ctx']} | {r['splits']} | {r.get('config', 'autotuned')} | {r['ms']:.3f} | "
              f"{r['tbs']:.2f} | {100 * r['tbs'] / ceil:.0f} % | {r['tflops']:.0f} | {100 * r['tflops'] / mm:.0f} % | "
              f"{r.get('rel_err', float('nan')):.2e} |", flush=True)

    def checked_sweep(variants_of):
        """At the memory-bound head counts (a TP shard of K3, kimi-linear's 32) and K3's 96, two
        split counts: each variant ``(label, mla_decode kwargs)`` checked on a 4K table, then timed."""
        print(head)
        for B, H in ((16, 16), (64, 16), (16, 32), (64, 32), (16, 96)):
            base = default_num_splits(B, H, 32768, torch.cuda.get_device_properties(0).multi_processor_count)
            for label, kw in variants_of(H):
                for splits in (base, 2 * base):
                    try:
                        err = case(B, H, 4096, splits=splits, **kw)["rel_err"]
                        r = case(B, H, 32768, splits=splits, check=False, **kw)
                    except Exception as exc:
                        print(f"| {B} | {H} | 32768 | {splits} | {label} | failed: "
                              f"{type(exc).__name__}: {str(exc)[:160]!r} ||||||")
                        continue
                    r.update(config=label, rel_err=err)
                    show(r)

    if "--gluon" in sys.argv:  # mla_decode_gluon's split step: keys-major (heads by 32), and heads-major from 64
        print(head)
        for B, H in ((16, 16), (64, 16), (16, 32), (64, 32), (16, 64), (16, 96), (32, 96), (64, 96), (16, 128),
                     (64, 128)):
            forms = [("gluon keys-major", "HEADS_MAJOR_MIN=None")]
            forms += [("gluon heads-major", "HEADS_MAJOR_MIN=64,SEESAW=False"),
                      ("gluon seesaw, cp.async ring", "HEADS_MAJOR_MIN=64,SEESAW=True,SEESAW_TMA=False"),
                      ("gluon seesaw, TMA ring", "HEADS_MAJOR_MIN=64,SEESAW=True,SEESAW_TMA=True")] * (H >= 64)
            for label, assigns in forms:
                with constants(",".join(f"k3serve.ops.mla_decode_gluon.{a}" for a in assigns.split(","))):
                    base = num_splits_for(B, H, 32768, torch.device("cuda"), True)
                    for splits in (base, 2 * base):
                        err = case(B, H, 4096, splits=splits, gluon=True)["rel_err"]
                        r = case(B, H, 32768, splits=splits, check=False, gluon=True)
                        r.update(config=label, rel_err=err)
                        show(r)
        return
    if "--mem" in sys.argv:  # the Triton kernel's tiles
        checked_sweep(lambda H: [(f"{bh},{bn},{w},{st}", {"tiles": dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w,
                                                                        num_stages=st)})
                                 for bh, bn, w, st in (MEM_SWEEP if H <= 32 else MEM_SWEEP_96)
                                 if bh <= max(16, triton.next_power_of_2(H))])
        return
    if "--no-sweep" not in sys.argv:
        print(head)
        for B, H in ((16, 96), (64, 16)):
            for bh, bn, w, st in SWEEP:
                if bh > max(16, triton.next_power_of_2(H)):
                    continue
                try:
                    r = case(B, H, 32768, check=False, tiles=dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=w, num_stages=st))
                except Exception as exc:  # a tile that does not fit is skipped
                    print(f"| {B} | {H} | 32768 | | {bh},{bn},{w},{st} | failed: {type(exc).__name__}: {str(exc)[:200]!r} ||||||")
                    continue
                r["config"] = f"{bh},{bn},{w},{st}"
                show(r)
    # kimi-linear's decode at batch 1 (32 heads, 4K context): the split count trades programs for
    # the fp32 partials' traffic ([H, splits, 512] written and merged: at 64 splits as many bytes
    # as the 4.7 MB of latent)
    print("\nbatch 1, 32 heads, 4K context, by split count (autotuned tiles):")
    print(head)
    for splits in (4, 8, 16, 32, 64):
        show(case(1, 32, 4096, splits=splits, check=splits == 8))
    rows = [case(2, 16, 300, check=True, gluon=None), case(3, 96, 1000, check=True, gluon=None),
            case(16, 96, 4096, check=True, gluon=None)]
    rows += [case(B, 96, 32768, check=False, gluon=None) for B in (16, 32, 64)]
    # a K3 TP shard's 16 heads, kimi-linear's 32
    rows += [case(B, H, 32768, check=False, gluon=None) for H in (16, 32) for B in (16, 64)]
    print("\nas the model calls it (the Gluon split step where mla_decode_triton.GLUON_SPLIT, else autotuned tiles):")
    print(head)
    for r in rows:
        show(r)

    def bound(r):  # (latent bytes, or FLOPs where those are the nearer ceiling: 96 heads absorbed, ~363 flop/byte)
        flops = r["tflops"] * r["ms"] * 1e9
        return (r["bytes"], "copy") if r["tbs"] / ceil >= r["tflops"] / mm else (flops, "matmul")

    return [Row(f"MLA decode, split-KV ({'Gluon' if r.get('config') == 'Gluon split step' else 'Triton'})",
                f"B {r['B']}, {r['H']} heads, context {r['ctx']}", r["ms"], *bound(r),
                check=f"rel err {r['rel_err']:.1e}" if "rel_err" in r else "")
            for r in rows]


if __name__ == "__main__":
    main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")

"""Routed-expert kernel check + timing on the GPU ([gpu-kernels] item 3; not a CI test).

The Triton grouped GEMM (MXFP4 upcast in registers by tl.dot_scaled, and bf16) against the plain-torch per-expert reference on fresh random routing,
then timed on K3's latent experts (896 MXFP4 experts, top-16, width 3584, intermediate 3072):
decode 1..64 tokens as TB/s on the expert
bytes actually read (target >= 60 % of copy), prefill 8K tokens as TFLOP/s (target >= 50 % of the
bf16 matmul ceiling), each next to the reference loop and with both ceilings measured in the same
run. A sweep over tile shapes and MMA orientation comes first (every variant checked against the
reference, so a fast wrong tile cannot win); its winners are the autotuner's candidates
(``moe_triton.GROUPED_GEMM_CONFIGS``). Kimi-Linear's bf16 experts (256, top-8, 2304 x 1024) get
a short decode sweep.

Usage: python bench/kernels_moe.py [--no-sweep] [--bf16-decode] [--mxfp4-only] [--decode-only] [--mma-only]
[--bf16-prefill-only] [--grouped-mm]
(--mma-only: the MMA-layout upcast's rows alone; --bf16-prefill-only: Kimi-Linear's bf16 prefill sweep and
the model's own call at 8K tokens, nothing else; --grouped-mm: the model's bf16 call beside torch's grouped GEMM
at 8K and 2K tokens, nothing else)
"""

import copy as copy_module
import sys
from types import SimpleNamespace

import torch
import triton

from bench.ceilings import copy_tbs, matmul_tflops
from bench.compare import rel
from bench.summary import Row
from bench.timing import by_kernel, gpu_ms

from k3serve.model.loader import load_model
from k3serve.ops.moe_ref import experts_ref
from k3serve.ops import moe_triton
from k3serve.ops.moe_triton import _grouped_gemm_tuned, experts_triton

# (block_m, BLOCK_N, SWAP_AB, BLOCK_K, warps, stages[, MXFP4 upcast]). The fifth session's sweep
# (RESULTS.md) covered dot_scaled over many tiles; its best are kept here as the autotuner's
# candidates' check, next to our PTX upcast ("asm", seventh session) on the same and wider tiles.
DECODE_VARIANTS = [(16, 64, False, 128, 4, 3), (16, 32, True, 256, 2, 4), (16, 32, True, 128, 2, 4)] + [
    (16, bn, swap, bk, w, st, "asm") for bn, swap, bk, w, st in (
        (64, False, 128, 4, 3), (32, True, 128, 2, 4), (32, True, 256, 2, 4), (64, True, 128, 4, 3),
        (128, True, 128, 4, 3), (128, True, 256, 8, 3))]
# The MMA-layout upcast ("mma", twelfth session): weights rewritten by RoutedExperts.use_mma_layout.
# 2-warp tiles (mma.sync) send the tile through shared memory: 20-22 % of copy, not kept. Of its
# sweep (64 / 128 / 256 wide, 4 / 8 warps, 2-5 stages: RESULTS.md twelfth and thirteenth sessions)
# the two best stay as the Gluon kernel's yardstick.
DECODE_VARIANTS += [(16, bn, True, bk, w, st, "mma") for bn, bk, w, st in ((64, 128, 4, 2), (64, 64, 4, 3))]
# The same layout through moe_gluon's kernel (64 weight rows, 4 warps, K steps of 128; stages: its copy ring,
# two slots fixed since the fifty-ninth session, the field ignored).
# Thirteenth session: 2 stages best (70 % of copy at 16 tokens; 3: 61 %); 78 registers, 25.6 KB:
# 6 programs an SM; register caps of 80 (the same) and 72 (slower) are out of the sweep. Fourteenth:
# row blocks of 8 (wgmma N = 8, 66 registers) beat 16 at 1 / 16 / 64 tokens (63 / 77 / 71 % of copy
# against 58 / 70 / 68), 3 stages lost again (46-53 %), gate and up paired on one chain lost (removed).
# The eighth element, where present: the Gluon kernel's options (maxnreg).
# Fifteenth session: programs ordered row block fastest, or column tile fastest (moe_gluon.COLS_FIRST_MIN_ROWS:
# at 256 tokens, rows of 16, 4.38 ms against 4.82). Row blocks of 8 or 16 an expert (expert_sort.sort_by_expert_sizes,
# one weight read an expert up to 16 rows): 4.25 ms at 256 tokens, but its torch sort costs ~0.11 ms
# (1 token: 0.220 against 0.105), so decode keeps one size.
DECODE_VARIANTS += [(bm, 64, True, 128, 4, 2, "gluon", {"cols_first": c}) for bm in (16, 8) for c in (False, True)]
# (ours at prefill row blocks: 4.5x slower than tl.dot_scaled, or a Triton 3.6 pass failure; seventh session)
PREFILL_VARIANTS = [(128, 128, False, 128, 8, 3), (128, 128, False, 128, 8, 4), (64, 128, False, 64, 4, 3)] + [
    (bm, bn, True, bk, w, st, "mma") for bm, bn, bk, w, st in (  # (the best two of the twelfth session's seven)
        (64, 64, 128, 4, 2), (128, 128, 128, 8, 3))] + [
    (64, 64, True, 128, 4, 2, "gluon")] + [  # (its K steps a double buffer since the fifty-ninth session)
    (bm, 64, True, 128, 8, 2, "gluon") for bm in (64, 128)] + [  # 8 warps: moe_gluon's STACKED form
    # row blocks of mixed sizes (expert_sort.sort_by_expert_sizes), each size at its default warps
    (sizes, 64, True, 128, None, 2, "gluon", opts) for sizes in ((32, 64, 128), (16, 32, 64, 128))
    for opts in ({"cols_first": False}, {"cols_first": True})] + [
    (64, 64, True, 128, 8, 2, "gluon", {"cols_first": True})]  # (a ring of 3 K steps: 26.3 ms against 24.3)
BF16_VARIANTS = [(16, 64, False, 128, 4, 3), (16, 32, False, 128, 4, 3), (16, 128, True, 128, 8, 3),
                 (16, 32, True, 128, 2, 4), (16, 128, False, 128, 8, 3), (16, 128, False, 128, 4, 4),
                 (16, 64, False, 256, 4, 3), (16, 64, False, 64, 4, 4), (16, 32, False, 256, 4, 4)]
BF16_PREFILL_VARIANTS = [(bm, bn, False, 64, w, st, "dot_scaled", {"cols_first": c})
                         for bm, bn in ((64, 128), (128, 128), (128, 256)) for w, st in ((4, 3), (8, 3), (8, 4))
                         for c in (False, True)]  # (cols_first: programs column tile fastest, fifteenth session)
# Row blocks of mixed sizes an expert (expert_sort.sort_by_expert_sizes): an expert's ~288 rows at 8K tokens take
# 128 + 128 + 32 rows instead of 3 x 128 (a quarter of the uniform blocks' rows are padding).
BF16_PREFILL_VARIANTS += [(sizes, bn, False, 64, w, 3, "dot_scaled", {"cols_first": True})
                          for sizes in ((64, 128), (32, 64, 128), (16, 32, 64, 128)) for bn, w in ((128, 8), (256, 8))]
# (2K tokens: ~64 rows an expert, so the 64-row blocks hold ~50 % padding; tails of 16 / 32 rows instead)
BF16_PREFILL_VARIANTS += [(sizes, 128, False, 64, w, st, "dot_scaled", {"cols_first": True})
                          for sizes in ((32, 64), (16, 32, 64)) for w, st in ((4, 4), (8, 3))]


def routing(moe, d, T):
    g = torch.Generator(device="cuda").manual_seed(T)
    xin = torch.randn(T, d, device="cuda", generator=g).bfloat16()
    w, ids = moe.gate(xin)
    return xin, w, ids


def work(ex, ids) -> tuple[int, float, float]:
    """(experts hit, GB of their weights read, FLOPs) of one routed-expert call."""
    hit = int(torch.unique(ids).numel())
    per_expert = 3 * ex.intermediate * ex.out_features * (17 / 32 if ex.mxfp4 else 2)
    return hit, hit * per_expert / 1e9, 2 * 3 * ids.numel() * ex.intermediate * ex.out_features


def sweep(ex, cases, variants, copy, mm, label, ex_mma=None):
    """Every variant on every (tokens, x, weights, ids, reference) case: checked, then timed. The
    "mma" upcast runs on ``ex_mma`` (the same experts in the MMA layout)."""
    print(f"\n{label}: tile sweep (block_m, BLOCK_N, swap, BLOCK_K, warps, stages, MXFP4 upcast)")
    print("| tokens | variant | ms | TB/s | % copy | TFLOP/s | % matmul | rel err |")
    print("|---|---|---|---|---|---|---|---|")
    for T, z, w, ids, ref in cases:
        _, gbytes, flops = work(ex, ids)
        for bm, bn, swap, bk, nw, st, *extra in variants:
            up, opts = (extra + ["dot_scaled", {}][len(extra):])[:2]  # (opts: the Gluon kernel's options)
            tiles = dict(BLOCK_N=bn, SWAP_AB=swap, num_stages=st, **opts, **({"num_warps": nw} if nw else {}))
            mma = up in ("mma", "gluon")
            if (mma and ex_mma is None) or (not mma and ex.mxfp4 and "--mma-only" in sys.argv):
                continue
            rows = dict(block_sizes=bm) if isinstance(bm, tuple) else dict(block_m=bm)
            bm = "+".join(map(str, bm)) if isinstance(bm, tuple) else bm
            run = lambda: experts_triton(z, w, ids, ex_mma if mma else ex, block_k=bk, tiles=tiles, mx_upcast=up, **rows)  # noqa: E731
            try:
                err = rel(run(), ref) if ref is not None else float("nan")
                ms = gpu_ms(run, rep=60)
            except Exception as exc:  # a tile that does not fit (shared memory, registers) is skipped
                print(f"| {T} | {bm},{bn},{swap},{bk},{nw},{st},{up} | failed: {type(exc).__name__}: {str(exc)[:200]!r} |||||| ", flush=True)
                continue
            name = up + "".join(f" {k}={v}" for k, v in opts.items())
            print(f"| {T} | {bm},{bn},{swap},{bk},{nw},{st},{name} | {ms:.3f} | {gbytes / ms:.2f} | "
                  f"{100 * gbytes / ms / copy:.0f} % | {flops / ms / 1e9:.0f} | {100 * flops / ms / 1e9 / mm:.0f} % | "
                  f"{err:.2e} |", flush=True)


def kimi_linear_experts():
    """Kimi-Linear-48B's routed experts (bf16, 256 x [1024, 2304]), random, without the model."""
    g = torch.Generator(device="cuda").manual_seed(5)
    E, inter, d = 256, 1024, 2304
    w = {n: (torch.randn(E, *shape, device="cuda", generator=g) * shape[1] ** -0.5).bfloat16()
         for n, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter)))}
    ex = SimpleNamespace(num_experts=E, num_shared=0, dtype=torch.bfloat16, mxfp4=False, intermediate=inter,
                         out_features=d, act=("silu", 1.0, None), **w)
    ex.expert = lambda e: (ex.w1[e], ex.w2[e], ex.w3[e])
    ex.stack = lambda name: (w[name], None)  # (moe.RoutedExperts.stack)
    return ex


def kimi_linear_cases(kl, tokens):
    """(tokens, x, routing weights, ids, fp32 reference) cases for ``kimi_linear_experts``, top-8 of random scores."""
    cases = []
    for T in tokens:
        g = torch.Generator(device="cuda").manual_seed(T)
        ids = torch.rand(T, kl.num_experts, device="cuda", generator=g).topk(8, dim=-1).indices
        w = torch.rand(T, 8, device="cuda", generator=g)
        z = torch.randn(T, 2304, device="cuda", generator=g).bfloat16()
        cases.append((T, z, w, ids, experts_ref(z.float(), w, ids, lambda e: tuple(t.float() for t in kl.expert(e)),
                                                *kl.act)))
    return cases


def bf16_prefill(copy, mm):
    """Kimi-Linear's bf16 experts at 8K tokens (row blocks of 128) and 2K (of 64): the sweep, then
    ``experts_triton`` as the model calls it, autotuned with and without the prefill tiles."""
    kl = kimi_linear_experts()
    cases = kimi_linear_cases(kl, (8192, 2048))
    if "--no-sweep" not in sys.argv:
        sweep(kl, cases, BF16_PREFILL_VARIANTS, copy, mm, "Kimi-Linear bf16 experts, prefill")
    print("\nthe model's call (autotuned), with and without the prefill tiles (moe_triton._PREFILL_TILES):\n"
          "| tokens | prefill tiles | round | ms | TFLOP/s | % matmul | rel err |\n|---|---|---|---|---|---|---|")
    first, picks = moe_triton.PREFILL_TILES_MIN_ROWS, []
    for T, z, w, ids, ref in cases:
        run = lambda: experts_triton(z, w, ids, kl)  # noqa: E731
        for r in range(3):  # alternating rounds
            for on in (True, False):
                moe_triton.PREFILL_TILES_MIN_ROWS = first if on else 1 << 30
                _grouped_gemm_tuned.cache.clear()  # (keyed by shape only: each candidate set picks again, or from disk)
                err, ms, (_, _, flops) = rel(run(), ref), gpu_ms(run, rep=60), work(kl, ids)
                if r == 0:
                    picks.append((T, on, [(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                                          for c in _grouped_gemm_tuned.cache.values()]))
                print(f"| {T} | {on} | {r} | {ms:.3f} | {flops / ms / 1e9:.0f} | {100 * flops / ms / 1e9 / mm:.0f} % | "
                      f"{err:.2e} |", flush=True)
    moe_triton.PREFILL_TILES_MIN_ROWS = first
    for T, on, tiles in picks:
        print(f"{T} tokens, prefill tiles {on}: picked (BLOCK_N, warps, stages) {tiles} (gate / up, down)")


def grouped_mm_rows(mm, tokens=(8192, 2048), rounds: int = 3):
    """Kimi-Linear's bf16 experts, the model's call (autotuned Triton) beside torch's grouped GEMM
    (``bench.moe_grouped_mm``): whole calls in alternating rounds, then each call's kernels, and the
    library's two GEMMs alone on rows sorted beforehand (what its GEMM would cost without the passes
    around it)."""
    from bench.moe_grouped_mm import expert_order, experts_grouped_mm, grouped_mm, stacked_gate_up

    kl = kimi_linear_experts()
    w13 = stacked_gate_up(kl)
    print("\nKimi-Linear bf16 experts, ours against torch's grouped GEMM (TFLOP/s on the routed FLOPs):\n"
          "| tokens | call | round | ms | TFLOP/s | % matmul | rel err |\n|---|---|---|---|---|---|---|")
    for T, z, w, ids, ref in kimi_linear_cases(kl, tokens):
        flops = work(kl, ids)[2]
        order, offs = expert_order(ids, kl.num_experts)
        xs = z[order // ids.shape[1]]
        a = torch.randn(xs.shape[0], kl.intermediate, device="cuda").bfloat16()
        calls = {"ours (experts_triton)": lambda: experts_triton(z, w, ids, kl),
                 "torch grouped_mm, whole": lambda: experts_grouped_mm(z, w, ids, kl, w13),
                 "torch grouped_mm, the two GEMMs": lambda: (grouped_mm(xs, w13, offs), grouped_mm(a, kl.w2, offs))}
        errs = {name: rel(fn(), ref) for name, fn in calls.items() if "two GEMMs" not in name}
        for r in range(rounds):
            for name, fn in calls.items():
                ms = gpu_ms(fn, rep=60)
                print(f"| {T} | {name} | {r} | {ms:.3f} | {flops / ms / 1e9:.0f} | {100 * flops / ms / 1e9 / mm:.0f} % | "
                      f"{errs.get(name, float('nan')):.2e} |", flush=True)
        for name, fn in calls.items():
            print(f"\n{T} tokens, {name}, by kernel:\n| kernel | launches | ms a call |\n|---|---|---|")
            for kname, n, kms in by_kernel(fn)[:8]:
                print(f"| {kname} | {n} | {kms:.4f} |")


def main() -> list[Row] | None:
    """Prints its tables; returns K3's MXFP4 experts as the model calls them (decode sizes on their
    bytes, 8K tokens on their FLOPs; the torch reference loop beside them up to 64 tokens) for
    ``bench.kernels``' one table (None after ``--bf16-prefill-only`` / ``--grouped-mm``)."""
    copy, mm = copy_tbs(), matmul_tflops()
    print(f"copy {copy:.2f} TB/s, bf16 matmul {mm:.0f} TFLOP/s")
    if "--bf16-prefill-only" in sys.argv:
        return bf16_prefill(copy, mm)
    if "--grouped-mm" in sys.argv:
        return grouped_mm_rows(mm)
    moe_triton.MMA_LAYOUT = False  # the checkpoint layout for dot_scaled / asm; "mma" gets its own copy below
    model = load_model(preset="k3-slice", device="cuda", dtype="bfloat16", seed=0)
    moe = model.model.layers[1].block_sparse_moe
    ex = moe.experts
    d = model.config.hidden_size
    ref_of = lambda z, w, ids: experts_ref(z, w, ids, ex.expert, *ex.act)  # noqa: E731
    cases = {}
    for T in (1, 16, 64, 256, 8192):
        xin, w, ids = routing(moe, d, T)
        z = moe.routed_expert_down_proj(xin)
        cases[T] = (T, z, w, ids, ref_of(z, w, ids))  # 8K tokens too: the prefill tiles are checked
    ex_mma = copy_module.deepcopy(ex)
    if not ex_mma.use_mma_layout():
        ex_mma = None
    if "--no-sweep" not in sys.argv:
        sweep(ex, [cases[T] for T in (1, 16, 64, 256)], DECODE_VARIANTS, copy, mm, "K3 MXFP4 experts, decode", ex_mma)
        if "--decode-only" not in sys.argv:
            sweep(ex, [cases[8192]], PREFILL_VARIANTS, copy, mm, "K3 MXFP4 experts, prefill", ex_mma)
    if "--no-sweep" not in sys.argv and "--mxfp4-only" not in sys.argv:
        kl = kimi_linear_experts()
        kl_cases = kimi_linear_cases(kl, (1, 16, 64, 8192))
        if "--bf16-decode" in sys.argv:  # 94-98 % of copy in the fifth session's sweep
            sweep(kl, kl_cases[:3], BF16_VARIANTS, copy, mm, "Kimi-Linear bf16 experts, decode")
            print("\nKimi-Linear bf16 experts, autotuned as the model calls them:\n| tokens | ms | TB/s | % copy | rel err |"
                  "\n|---|---|---|---|---|")
            for T, z, w, ids, ref in kl_cases[:3]:
                run = lambda: experts_triton(z, w, ids, kl)  # noqa: E731
                err, ms, (_, gbytes, _) = rel(run(), ref), gpu_ms(run, rep=60), work(kl, ids)
                print(f"| {T} | {ms:.3f} | {gbytes / ms:.2f} | {100 * gbytes / ms / copy:.0f} % | {err:.2e} |", flush=True)
        # the same grouped GEMM without any upcast: what its structure allows at prefill
        if "--decode-only" not in sys.argv:
            sweep(kl, kl_cases[3:], BF16_PREFILL_VARIANTS, copy, mm, "Kimi-Linear bf16 experts, prefill")
    print("\nautotuned tiles (experts_triton as the model calls it), each MXFP4 upcast:")
    print("| upcast | tokens | experts hit | ours ms | ref ms | rel err | expert GB read | TB/s | % copy | TFLOP/s | % matmul |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    served = "gluon" if ex_mma is not None else "dot_scaled"  # (the MMA layout: the model's own choice of upcast)
    ref_ms, summary = {}, []
    for up, (T, z, w, ids, ref) in [(up, c) for up in ("dot_scaled", "asm", "mma", "gluon") for c in cases.values()
                                    if up != "asm" or c[0] <= 256]:  # (asm serves decode only)
        mma = up in ("mma", "gluon")
        if (mma and ex_mma is None) or (not mma and "--mma-only" in sys.argv):
            continue
        # (MMA-layout experts with no upcast named take the model's own choice: "gluon" where it serves)
        ours = lambda: experts_triton(z, w, ids, ex_mma if mma else ex, mx_upcast=None if up == "gluon" else up)  # noqa: E731
        err = rel(ours(), ref)
        t_ours = gpu_ms(ours, rep=100)
        if T <= 64 and T not in ref_ms:  # (the reference loop: host-bound, plain launches)
            ref_ms[T] = triton.testing.do_bench(lambda: ref_of(z, w, ids), warmup=3, rep=20, return_mode="median")
        t_ref = ref_ms.get(T, float("nan"))
        hit, gbytes, flops = work(ex, ids)
        if up == served:
            summary.append(Row(f"routed experts, K3 MXFP4 ({up} upcast)", f"{T} tokens, {hit} of 896 experts",
                               t_ours, gbytes * 1e9 if T <= 256 else flops, "copy" if T <= 256 else "matmul",
                               "torch reference loop" if T <= 64 else "", t_ref, f"rel err {err:.1e}"))
        print(f"| {up} | {T} | {hit} | {t_ours:.3f} | {t_ref:.3f} | {err:.2e} | {gbytes:.2f} | {gbytes / t_ours:.2f} | "
              f"{100 * gbytes / t_ours / copy:.0f} % | {flops / t_ours / 1e9:.0f} | "
              f"{100 * flops / t_ours / 1e9 / mm:.0f} % |", flush=True)
    for key, c in _grouped_gemm_tuned.cache.items():  # what the autotuner picked per shape
        print(f"tuned {key}: {c.kwargs} warps {c.num_warps} stages {c.num_stages}")
    return summary


if __name__ == "__main__":
    main()
    if gpu_ms.eager:
        print("timed by plain launches (not capturable):", *sorted(set(gpu_ms.eager)), sep="\n  ")

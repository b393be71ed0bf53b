"""Two variants of module constants on one eager prefill step, the same prompts (run on the GPU).

Why: the forty-second session saw k3-slice's 1 x 512 eager step ~1.2 ms slower with FlashKDA
(``fla_backend.FLASH_KDA``) although its KDA core was faster; the extra time sat in the MXFP4
grouped GEMMs that follow. A MoE's time follows its routing, and its routing follows the hidden
states the KDA layers hand on. This script separates the two:

1. every KDA mixer of variant B runs on variant A's inputs (a pre-hook swaps them in): its output
   against A's, so each layer's own difference shows, not the sum of those before it;
2. the routing of each MoE under A and under B (own inputs): distinct experts, largest expert;
3. each MoE's routed experts timed on A's captured inputs and on B's, alternately, in one process:
   if B's inputs are slower, routing explains the step; if not, something else does;
4. the whole eager step timed, A and B alternating (CUDA events, median).

Usage: python bench/variant_step_probe.py --preset k3-slice --tokens 512 \
         --a "fla:k3serve.ops.fla_backend.FLASH_KDA=False" --b "flashkda:"
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

from bench.gpu_check_graphs import eager_step, step_inputs, timed
from bench.overrides import restore, set_constants
from k3serve.model.kda import KDAMixer
from k3serve.model.loader import load_model
from k3serve.model.moe import RoutedExperts


def capture(model, pool, chunks, swap_inputs: list | None = None) -> dict:
    """One eager step with hooks: each KDA mixer's input and output, each routed-experts call's
    arguments. ``swap_inputs``: KDA inputs to run on instead of the step's own (item 1)."""
    kda_in, kda_out, moe_calls, handles = [], [], [], []
    kdas = [m for m in model.modules() if isinstance(m, KDAMixer)]
    for i, m in enumerate(kdas):
        def pre(mod, args, i=i):
            if swap_inputs is not None:
                return (swap_inputs[i],) + tuple(args[1:])
        def post(mod, args, out):
            kda_in.append(args[0].clone())
            kda_out.append(out.clone())
        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            def grab(mod, args, kwargs):
                moe_calls.append((mod, tuple(a.clone() if torch.is_tensor(a) else a for a in args), dict(kwargs)))
            handles.append(m.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        logits = eager_step(model, pool, chunks).float()
    finally:
        for h in handles:
            h.remove()
    return {"kda_in": kda_in, "kda_out": kda_out, "moe": moe_calls, "logits": logits}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def routing(ids: torch.Tensor, num_experts: int) -> dict:
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    return {"distinct": int((counts > 0).sum()), "max": int(counts.max()), "assignments": int(ids.numel())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="k3-slice")
    ap.add_argument("--tokens", default="512", help="comma-separated prompt lengths (one prompt each)")
    ap.add_argument("--a", default="fla:k3serve.ops.fla_backend.FLASH_KDA=False")
    ap.add_argument("--b", default="flashkda:")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = load_model(preset=args.preset, dtype="bfloat16", device="cuda", seed=0, progress=False)
    (na, sa), (nb, sb) = (s.partition(":")[::2] for s in (args.a, args.b))
    for n in (int(t) for t in args.tokens.split(",")):
        pool, chunks = step_inputs(model, random.Random(args.seed + n), 1, 0, 4 << 30, new_tokens=n)
        saved = set_constants(sa)
        A = capture(model, pool, chunks)
        restore(saved)
        saved = set_constants(sb)
        B_on_A = capture(model, pool, chunks, swap_inputs=A["kda_in"])
        B = capture(model, pool, chunks)
        restore(saved)
        print(f"\n## {args.preset}, 1 x {n} tokens: {nb} against {na}")
        print("\n| KDA layer | rel diff of its output on A's input | rel diff of its input (own runs) |\n|---|---|---|")
        for i, (o_a, o_b) in enumerate(zip(A["kda_out"], B_on_A["kda_out"])):
            print(f"| {i} | {rel(o_b, o_a):.3e} | {rel(B['kda_in'][i], A['kda_in'][i]):.3e} |")
        print(f"\nlogits rel diff (own runs): {rel(B['logits'], A['logits']):.3e}; "
              f"argmax equal: {bool((B['logits'].argmax(-1) == A['logits'].argmax(-1)).all())}")
        print(f"\n| MoE | routing {na} | routing {nb} | ids equal | experts ms on {na}'s inputs | on {nb}'s |"
              "\n|---|---|---|---|---|---|")
        for j, ((mod, args_a, kw_a), (_, args_b, kw_b)) in enumerate(zip(A["moe"], B["moe"])):
            ne = mod.num_experts + mod.num_shared
            ta, tb = [], []
            with torch.inference_mode():
                for _ in range(args.rounds):
                    ta.append(timed(lambda: mod(*args_a, **kw_a), args.iters))
                    tb.append(timed(lambda: mod(*args_b, **kw_b), args.iters))
            eq = float((args_a[2] == args_b[2]).float().mean())
            print(f"| {j} | {routing(args_a[2], ne)} | {routing(args_b[2], ne)} | {eq:.3f} | "
                  f"{statistics.median(ta):.4f} | {statistics.median(tb):.4f} |")
        steps = {na: [], nb: []}
        for _ in range(args.rounds):
            for name, assigns in ((na, sa), (nb, sb)):
                saved = set_constants(assigns)
                steps[name].append(timed(lambda: eager_step(model, pool, chunks), args.iters))
                restore(saved)
        print(f"\neager step ms by round: {na} {[round(t, 3) for t in steps[na]]}, {nb} {[round(t, 3) for t in steps[nb]]}")
        del pool
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

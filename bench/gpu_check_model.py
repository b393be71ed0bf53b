"""GPU correctness check for [model-core] (run on the H200; not a CI test).

1. KDA core through fla-core (bf16 inputs, fp32 slot pool) vs the plain-torch reference (fp32),
   fresh random inputs, several shapes, both gate forms, a mixed decode + prefill batch with
   initial states in slots; untouched slots must stay untouched.
2. tiny preset: bf16 on CUDA (fla for KDA) vs the fp32 CPU reference, prefill of 3 sequences in
   one flat batch + 8 batched decode steps. Then the same for kimi-linear-48b's config at small
   widths (``kimi_linear_small``: the layer path without AttnRes, one expert group, joined shared
   experts), and each model's sublayers teacher-forced.
3. k3-slice preset (true K3 widths, MXFP4 experts, dummy weights generated on the GPU): bf16 +
   fla vs the fp32 plain-torch reference path run on the same GPU (the fp32 model does not fit
   the machine's host RAM; the reference code is the same one CI runs on CPU).

Usage: python bench/gpu_check_model.py [--out DIR] [--skip-slice] [--skip-tiny] [--skip-linear-small] [--skip-kda]
       [--backends auto,triton]
       [--set module.CONST=value,...]
Prints a table; writes results.json under --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch

from bench.compare import rel
from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.config import ModelConfig
from k3serve.model.k3 import K3ForCausalLM
from k3serve.model.loader import load_model, resolve_dtype
from k3serve.model.moe import RoutedExperts
from k3serve.model.weights import load_dummy
from k3serve.presets import preset_config
from k3serve.ops import backend as kernel_backend
from k3serve.ops import fla_backend
from k3serve.ops import kda as kda_ops
from k3serve.ops import moe_triton
from k3serve.ops.kda_ref import kda_gate, l2norm

ROWS: list[dict] = []


def check_kda_core(H: int, D: int, lower_bound: float | None, seed: int, fresh_prefill: bool = False) -> None:
    """fla's kda_core (decay passed, and computed in its chunk kernel) vs the torch reference: a
    mixed step (decodes, one of them fresh, then prefill chunks with and without context), or with
    ``fresh_prefill`` new prompts alone (fla from zero states, its output returned as is)."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(seed)
    if fresh_prefill:
        qlens, ctx, slots = [37, 300, 64], [0, 0, 0], [3, 0, 9]
    else:
        qlens = [1, 1, 1, 37, 300, 64]  # 3 decodes (one of them fresh), then prefill chunks
        ctx = [5, 0, 90, 0, 130, 64]
        slots = [7, 2, 4, 0, 5, 9]
    T = sum(qlens)
    chunks = [SeqChunk([0] * q, c, s, list(range(8))) for q, c, s in zip(qlens, ctx, slots)]
    batch = ForwardBatch.build(chunks, page_size=64, device=dev)
    r = lambda *s: torch.randn(*s, generator=gen, device=dev)  # noqa: E731
    q, k, v = (r(T, H, D).bfloat16() for _ in range(3))
    f = (r(T, H, D) * 3).bfloat16()  # the gate pre-activation, bf16 as the projection makes it
    gate = (torch.rand(H, generator=gen, device=dev) * 2.5, r(H * D), lower_bound)
    g = kda_gate(f, *gate)
    beta = torch.rand(T, H, generator=gen, device=dev)
    pool = r(12, H, D, D) * 0.1
    outs = {}
    # fla twice: with the decay passed, and computed from f inside its chunk kernel (the model's call)
    # fla_prenorm: q and k normalised before (as kda.CONV_NORMS_QK's conv does), fla told so
    # fla_direct: fla_prenorm through fla's forward without its wrappers (fla_backend.DIRECT_FORWARD);
    # with a bounded gate those take fla's safe_gate path (fla_backend.SAFE_GATE), fla_direct_nosafe not
    variants = [("torch", "torch", False, False), ("fla", "fla", False, False), ("fla_gate", "fla", True, False),
                ("fla_prenorm", "fla", True, True), ("fla_direct", "fla", True, True)]
    if fla_backend.safe_gate(lower_bound):
        variants.append(("fla_direct_nosafe", "fla", True, True))
    # flash_kda: the prefill sequences through FlashKDA (fla_backend.FLASH_KDA) where it applies and is installed
    if D == 128 and fla_backend.safe_gate(lower_bound) and fla_backend._flash_kda() is not None:
        variants.append(("flash_kda", "fla", True, True))
    defaults = fla_backend.DIRECT_FORWARD, fla_backend.SAFE_GATE, fla_backend.FLASH_KDA
    for name, backend, in_kernel, pre in variants:
        fla_backend.DIRECT_FORWARD = name.startswith("fla_direct") or name == "flash_kda"
        fla_backend.SAFE_GATE = name != "fla_direct_nosafe"
        fla_backend.FLASH_KDA = name == "flash_kda"
        st = pool.clone()
        inp = [x.float() if backend == "torch" else x for x in (q, k, v)]
        if pre:
            inp[:2] = [l2norm(x).bfloat16() for x in inp[:2]]
        torch.cuda.synchronize()
        o = kda_ops.kda_core(*inp, f if in_kernel else g, beta, D ** -0.5, st, batch, backend=backend,
                             gate=gate if in_kernel else None, qk_normalized=pre)
        outs[name] = (o.float(), st)
    o_ref, s_ref = outs["torch"]
    untouched = [i for i in range(12) if i not in slots]
    fla_backend.DIRECT_FORWARD, fla_backend.SAFE_GATE, fla_backend.FLASH_KDA = defaults
    for name in [v[0] for v in variants[1:]]:
        o_fla, s_fla = outs[name]
        ROWS.append(dict(check=f"kda_core {name} vs torch ref" + (", new prompts only" if fresh_prefill else ""),
                         shape=f"H={H} D={D} T={T} lb={lower_bound}",
                         rel_err_out=rel(o_fla, o_ref), rel_err_state=rel(s_fla[slots], s_ref[slots]),
                         untouched_slots_equal=bool(torch.equal(s_fla[untouched], pool[untouched]))))


def _prompts(vocab: int, lens, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 256, (n,), generator=gen).tolist() for n in lens]


def run_model(model, prompts, steps: int, page: int = 64):
    """Prefill all prompts in one flat batch (caches sized for ``steps`` more tokens)."""
    device = next(model.parameters()).device
    cfg = model.config
    n_pages = [-(-(len(p) + steps) // page) for p in prompts]
    starts = [sum(n_pages[:i]) for i in range(len(prompts))]
    pages = [list(range(s, s + n)) for s, n in zip(starts, n_pages)]
    caches = CacheHandles.allocate(cfg, len(prompts), sum(n_pages), page, device=device, dtype=model.dtype)
    batch = ForwardBatch.build([SeqChunk(p, 0, i, pages[i]) for i, p in enumerate(prompts)], page, device)
    logits = [model.compute_logits(model(batch, caches)).float().cpu()]
    return logits, caches, pages


def decode(model, prompts, caches, pages, tokens, first_step: int = 0, page: int = 64):
    """One decode step per entry of ``tokens`` (a token per sequence), starting at ``first_step``."""
    device = next(model.parameters()).device
    out = []
    for step, toks in enumerate(tokens, start=first_step):
        chunks = [SeqChunk([t], len(p) + step, i, pages[i]) for i, (p, t) in enumerate(zip(prompts, toks))]
        out.append(model.compute_logits(model(ForwardBatch.build(chunks, page, device), caches)).float().cpu())
    return out


def compare_models(name: str, ref_model_fn, test_model_fn, lens, steps: int) -> None:
    t0 = time.perf_counter()
    ref = ref_model_fn()
    prompts = _prompts(ref.config.vocab_size, lens, 0)
    ref_pre, caches, pages = run_model(ref, prompts, steps)
    last = ref_pre[0][ForwardBatch.build([SeqChunk(p, 0, 0, [0] * 64) for p in prompts], 64).logits_indices]
    tokens, ref_dec = [], []
    for step in range(steps):  # the reference's greedy tokens drive both runs
        toks = last.argmax(-1).tolist()
        tokens.append(toks)
        last = decode(ref, prompts, caches, pages, [toks], first_step=step)[0]
        ref_dec.append(last)
    del ref, caches
    gc.collect()
    torch.cuda.empty_cache()
    t1 = time.perf_counter()
    test = test_model_fn()
    test_pre, caches, pages = run_model(test, prompts, steps)
    test_dec = decode(test, prompts, caches, pages, tokens)
    agree = [float((a.argmax(-1) == b.argmax(-1)).float().mean()) for a, b in
             zip([test_pre[0]] + test_dec, [ref_pre[0]] + ref_dec)]
    ROWS.append(dict(check=f"{name} bf16 vs fp32 ref", shape=f"prompts {lens}, {steps} decode steps",
                     rel_err_prefill=rel(test_pre[0], ref_pre[0]),
                     rel_err_decode=rel(torch.cat(test_dec), torch.cat(ref_dec)),
                     argmax_agreement=sum(agree) / len(agree),
                     seconds=round(time.perf_counter() - t0, 1), ref_seconds=round(t1 - t0, 1)))
    del test, caches
    gc.collect()
    torch.cuda.empty_cache()


def kimi_linear_small(device, dtype, quantization: str | None = None) -> "K3ForCausalLM":
    """kimi-linear-48b's config at small widths: the layer path the tiny preset does not take (no
    AttnRes: pre-norm residual adds, fused into the sublayers' last kernels at decode; one expert
    group: the router launch routes; bf16 experts with the shared one joined; low-rank KDA gates).
    Dummy weights drawn on the CPU, as the tiny preset's (both runs see the same weights).
    ``quantization="mxfp4"``: its bf16 experts quantised as they load (``--quantization mxfp4``: the
    shared expert quantised and joined to the MXFP4 stacks, no latent projections). Fused again on
    the device, as an engine that loads there does: MXFP4 stacks take the MMA layout on Hopper, so
    the quantised rows go through the Gluon kernel the server runs (before the fifty-sixth session's
    fix they took the checkpoint layout's Triton upcasts)."""
    raw = preset_config("kimi-linear-48b")
    raw.update(vocab_size=2048, hidden_size=256, num_hidden_layers=5, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               num_experts=32, num_experts_per_token=4, moe_intermediate_size=128, bos_token_id=1900,
               eos_token_id=1902, pad_token_id=2047)
    raw["linear_attn_config"].update(kda_layers=[1, 2, 4], full_attn_layers=[3, 5], num_heads=4, head_dim=64)
    cfg = ModelConfig.from_dict(raw).with_quantization(quantization)
    net = K3ForCausalLM(cfg, resolve_dtype(dtype, torch.device("cpu")), "cpu")
    load_dummy(net, 0)
    net.fuse_projections()
    net = net.eval().to(device)
    net.fuse_projections()  # (idempotent: on the GPU, the MMA layout of MXFP4 stacks)
    stacks = [m for m in net.modules() if isinstance(m, RoutedExperts) and m.mxfp4]
    if stacks and moe_triton.has_bf16x2_mul(torch.device(device)):  # the served path, or the rows say nothing
        assert all(m.mma_layout and m.folded_scales for m in stacks), "MXFP4 stacks not in the Gluon kernel's layout"
    return net


def _ffn(layer):
    return layer.block_sparse_moe if hasattr(layer, "block_sparse_moe") else layer.mlp


def sublayer_errors(name: str, ref_model_fn, test_model_fn, length: int) -> None:
    """Teacher-forced: every sublayer of the test model gets the reference's own input (cast to
    the test dtype), so the error of each op is seen without the chaotic growth through depth
    (random MoE routers flip experts on near-ties, which dominates end-to-end error)."""
    ref = ref_model_fn()
    prompt = _prompts(ref.config.vocab_size, [length], 1)[0]
    captured = []
    routes = {}
    hooks = []
    for i, layer in enumerate(ref.model.layers):
        if hasattr(layer, "block_sparse_moe"):
            hooks.append(layer.block_sparse_moe.gate.register_forward_hook(
                lambda m, args, out, i=i: routes.__setitem__(  # (the routed choices: not a joined shared expert)
                    i, out[1][:, :m.args["top_k"]].sort(-1).values.cpu())))
        for kind, mod in (("attn", layer.self_attn), ("ffn", _ffn(layer))):
            hooks.append(mod.register_forward_hook(
                lambda m, args, out, i=i, kind=kind: captured.append((i, kind, args[0].float().cpu(), out.float().cpu()))))
    run_model(ref, [prompt], 0)
    for h in hooks:
        h.remove()
    del ref
    gc.collect()
    torch.cuda.empty_cache()
    test = test_model_fn()
    device = next(test.parameters()).device
    pages = list(range(-(-length // 64)))
    batch = ForwardBatch.build([SeqChunk(prompt, 0, 0, pages)], 64, device)
    for i, kind, x, ref_out in captured:
        layer = test.model.layers[i]
        xt = x.to(device=device, dtype=test.dtype)
        if kind == "attn":
            caches = CacheHandles.allocate(test.config, 1, len(pages), 64, device=device, dtype=test.dtype)
            cache = caches.kda[test.cache_index[i]] if layer.is_kda else caches.mla[test.cache_index[i]]
            out = layer.self_attn(xt, batch, cache)
            what = "KDA" if layer.is_kda else "MLA"
        else:
            out = _ffn(layer)(xt)
            what = "MoE" if hasattr(layer, "block_sparse_moe") else "dense MLP"
        row = dict(check=f"{name} layer {i} {what} bf16 vs fp32 ref (teacher-forced)", shape=f"T={length}",
                   rel_err=rel(out.float().cpu(), ref_out))
        if what == "MoE":  # tokens whose expert set is identical; a flipped expert dominates the error
            ids = layer.block_sparse_moe.gate(xt)[1].sort(-1).values.cpu()
            same = (ids == routes[i]).all(-1)
            row["same_experts"] = float(same.float().mean())
            row["rel_err_same_experts"] = rel(out.float().cpu()[same], ref_out[same])
        ROWS.append(row)
    del test
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-slice", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--skip-linear-small", action="store_true", help="skip kimi-linear-48b's config at small widths")
    ap.add_argument("--backends", default="auto,triton", help="model runs to compare: auto (fla), triton (every kernel)")
    ap.add_argument("--skip-kda", action="store_true", help="skip the kda_core checks (fla autotuning takes a while)")
    ap.add_argument("--kda-heads", default="4,32,96", help="the kda_core checks' head counts, of 4 (D 32, bounded "
                    "gate), 32 (kimi-linear's gate) and 96 (K3's)")
    ap.add_argument("--dump-stacks-after", type=float, default=0, help="print every thread's stack after N s "
                    "(and every N s after that): where a slow run spends its time")
    ap.add_argument("--set", default="", help="module constants for the whole run, 'module.CONST=value,...' "
                    "(a flag checked before it turns on)")
    args = ap.parse_args()
    if args.set:
        from bench.overrides import set_constants

        print("set", args.set, set_constants(args.set), flush=True)
    if args.dump_stacks_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_stacks_after, repeat=True)
    backends = args.backends.split(",")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    kda_heads = {int(h) for h in args.kda_heads.split(",")}
    for H, D, lb, seed in ((4, 32, -5.0, 0), (32, 128, None, 1), (96, 128, -5.0, 2)):
        if args.skip_kda:
            break
        if H not in kda_heads:
            continue
        for fresh in (False, True):
            n = len(ROWS)
            check_kda_core(H, D, lb, seed, fresh)
            print(*ROWS[n:], sep="\n", flush=True)

    def with_backend(model_fn, device, dtype, backend):
        """backend: torch (reference), auto (fla for KDA), or triton (every opt-in Triton kernel)."""
        def make():
            kernel_backend.override("KDA", backend)
            for op in ("MLA", "MOE", "ATTNRES", "NORM", "GLU"):
                kernel_backend.override(op, "triton" if backend == "triton" else "torch")
            return model_fn(device, dtype)
        return make

    def small_model_rows(label, model_fn):
        """A small model's rows: whole, per backend, then teacher-forced sublayers; the fp32 reference on the CPU."""
        for backend in backends:
            compare_models(f"{label} [{backend}]", with_backend(model_fn, "cpu", "float32", "torch"),
                           with_backend(model_fn, "cuda", "bfloat16", backend), [13, 100, 41], 8)
            print(ROWS[-1], flush=True)
        sublayer_errors(label, with_backend(model_fn, "cpu", "float32", "torch"),
                        with_backend(model_fn, "cuda", "bfloat16", "auto"), 150)

    for mx in () if args.skip_tiny else (False, True):
        # Weights drawn on the CPU for both runs (CPU and CUDA generators give different streams).
        small_model_rows(f"tiny{'-mxfp4' if mx else ''}", lambda dev, dt, mx=mx: load_model(
            preset="tiny", device="cpu", dtype=dt, seed=0, mxfp4=mx).to(dev))
    for q in () if args.skip_linear_small else (None, "mxfp4"):
        small_model_rows(f"kimi-linear-small{' -q ' + q if q else ''}", lambda dev, dt, q=q: kimi_linear_small(dev, dt, q))
    if not args.skip_slice:
        sl = lambda dev, dt: load_model(preset="k3-slice", device=dev, dtype=dt, seed=0)  # noqa: E731
        for backend in backends:
            compare_models(f"k3-slice [{backend}]", with_backend(sl, "cuda", "float32", "torch"),
                           with_backend(sl, "cuda", "bfloat16", backend), [64, 200], 4)
            print(ROWS[-1], flush=True)
        sublayer_errors("k3-slice", with_backend(sl, "cuda", "float32", "torch"),
                        with_backend(sl, "cuda", "bfloat16", "auto"), 200)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "results.json").write_text(json.dumps(ROWS, indent=1))
    print("\n| check | shape | figures |\n|---|---|---|")
    for r in ROWS:
        figs = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                         if k not in ("check", "shape"))
        print(f"| {r['check']} | {r['shape']} | {figs} |")


if __name__ == "__main__":
    main()

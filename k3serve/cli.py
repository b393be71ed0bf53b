"""``k3serve`` command line: make-model, check (serve / generate / bench / plan arrive with their issues)."""

from __future__ import annotations

import argparse
import sys
import time

from .presets import PRESETS


def _make_model(args: argparse.Namespace) -> int:
    from .make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed, mxfp4=True if args.mxfp4 else None,
                     max_shard_bytes=int(args.max_shard_gib * (1 << 30)))
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    """Load a model (files or dummy), run one prefill + a few greedy decode steps, report."""
    import torch

    from .model.batch import CacheHandles, ForwardBatch, SeqChunk
    from .model.loader import load_model

    t0 = time.perf_counter()
    model = load_model(args.model, preset=args.preset, load_format=args.load_format, dtype=args.dtype,
                       device=args.device, seed=args.seed, verify_checksums=args.verify_checksums)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded {cfg.model_type}: {cfg.num_hidden_layers} layers ({cfg.num_kda_layers} KDA, {cfg.num_mla_layers} MLA), "
          f"{n_params / 1e6:.1f}M stored parameters, experts {cfg.expert_format}, {model.dtype}, "
          f"{time.perf_counter() - t0:.1f}s")
    device = next(model.parameters()).device
    page = 64
    pages = list(range(-(-(args.prompt_len + args.steps) // page)))
    caches = CacheHandles.allocate(cfg, 1, len(pages), page, device=device, dtype=model.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, cfg.vocab_size - 256, (args.prompt_len,), generator=gen).tolist()
    t0 = time.perf_counter()
    logits = model.compute_logits(model(ForwardBatch.build([SeqChunk(ids, 0, 0, pages)], page, device), caches))
    out = []
    for _ in range(args.steps):
        tok = int(logits[-1].argmax())
        out.append(tok)
        batch = ForwardBatch.build([SeqChunk([tok], len(ids) + len(out) - 1, 0, pages)], page, device)
        logits = model.compute_logits(model(batch, caches))
    if not torch.isfinite(logits).all():
        print("non-finite logits", file=sys.stderr)
        return 1
    print(f"prefill {args.prompt_len} + {args.steps} decode steps in {time.perf_counter() - t0:.2f}s; "
          f"greedy tokens: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve", description="Serving engine for the Kimi K3 model family")
    sub = p.add_subparsers(dest="command", required=True)

    mk = sub.add_parser("make-model", help="write a random-weight checkpoint in the real layout")
    mk.add_argument("--preset", required=True, choices=list(PRESETS))
    mk.add_argument("--out", required=True)
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--mxfp4", action="store_true", help="MXFP4 routed experts (as K3 ships them)")
    mk.add_argument("--max-shard-gib", type=float, default=2.0)
    mk.set_defaults(func=_make_model)

    ck = sub.add_parser("check", help="load a model and run a prefill + greedy decode smoke test")
    src = ck.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory")
    src.add_argument("--preset", choices=list(PRESETS), help="built-in shape with random weights")
    ck.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    ck.add_argument("--dtype", default="auto")
    ck.add_argument("--device", default=None)
    ck.add_argument("--seed", type=int, default=0)
    ck.add_argument("--prompt-len", type=int, default=32)
    ck.add_argument("--steps", type=int, default=8)
    ck.add_argument("--verify-checksums", action="store_true")
    ck.set_defaults(func=_check)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

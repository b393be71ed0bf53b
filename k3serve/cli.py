"""``k3serve`` command line: generate, make-model, check (serve / bench / plan arrive with their issues)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .bundled import BUNDLED_MODELS, DEFAULT_MODEL, resolve_model
from .presets import PRESETS


def _positive_int(text: str) -> int:
    """argparse type: sizes, counts and parallel degrees are integers >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _make_model(args: argparse.Namespace) -> int:
    from .make_model import make_model

    out = make_model(args.preset, args.out, seed=args.seed, mxfp4=True if args.mxfp4 else None,
                     max_shard_bytes=int(args.max_shard_gib * (1 << 30)))
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0


def _check(args: argparse.Namespace) -> int:
    """Load a model (files or dummy), run one prefill + a few greedy decode steps, report."""
    import torch

    from .engine.engine import EngineConfig, validate_startup
    from .model.batch import CacheHandles, ForwardBatch, SeqChunk
    from .model.loader import load_model

    t0 = time.perf_counter()
    validate_startup(None if args.preset else resolve_model(args.model), args.preset, EngineConfig(), args.device,
                     quantization=args.quantization, dtype=args.dtype)  # (memory and kernels, before a weight loads)
    model = load_model(args.model and resolve_model(args.model), preset=args.preset, load_format=args.load_format,
                       dtype=args.dtype, device=args.device, seed=args.seed, verify_checksums=args.verify_checksums,
                       quantization=args.quantization)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    print(f"loaded {cfg.model_type}: {cfg.num_hidden_layers} layers ({cfg.num_kda_layers} KDA, {cfg.num_mla_layers} MLA), "
          f"{n_params / 1e6:.1f}M stored parameters, experts {cfg.expert_format}"
          f"{' (quantised at load)' if cfg.experts_quantized_at_load else ''}, {model.dtype}, "
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


def add_quantization_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantization", "-q", choices=["mxfp4"], default=None,
                   help="mxfp4: serve bf16 routed experts as MXFP4 (W4A16, K3's format), quantised at load")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object is needed")
    return value


def add_engine_args(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Flags shared by every command that runs the engine (vLLM's names where the concept matches)."""
    src = p.add_mutually_exclusive_group(required=model_required)
    src.add_argument("--model", help=f"checkpoint directory or a bundled model ({', '.join(BUNDLED_MODELS)}); "
                                     f"default: the bundled {DEFAULT_MODEL!r}")
    src.add_argument("--preset", choices=list(PRESETS), help="built-in shape with random weights (token-id prompts)")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--weights-seed", type=int, default=0, help="seed of dummy / preset weights")
    p.add_argument("--verify-checksums", action="store_true")
    add_quantization_arg(p)
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="checked against the model (legal degrees, memory) before loading; this engine serves one "
                        "device so far, so > 1 is refused after the check (see `k3serve plan` for layouts)")
    p.add_argument("--expert-parallel-size", "-ep", type=_positive_int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=_positive_int, default=1)
    p.add_argument("--max-num-batched-tokens", type=_positive_int, default=8192)
    p.add_argument("--max-num-seqs", type=_positive_int, default=256)
    p.add_argument("--max-model-len", type=_positive_int, default=None)
    p.add_argument("--page-size", type=_positive_int, default=64)
    p.add_argument("--cache-memory", default=None, help="cache pool size, e.g. 2GiB (default on CPU: 1GiB)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--no-unified-memory", action="store_true", help="static split of the pool (baseline)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--prefix-block-size", type=_positive_int, default=512, help="tokens per prefix hash block")
    p.add_argument("--kda-checkpoint-interval", type=_positive_int, default=4096,
                   help="KDA checkpoint every N tokens inside long prefills (multiple of the block size)")
    p.add_argument("--kda-fraction", type=float, default=0.5, help="KDA share of the pool with --no-unified-memory")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (decode or prefill steps)")
    p.add_argument("--max-prefill-graph-tokens", type=int, default=2048,
                   help="prefill steps of new prompts under this many tokens replay CUDA graphs (0: none)")
    p.add_argument("--max-prefill-graph-decodes", type=int, default=16,
                   help="decode rows such a step may lead with (0: new prompts only)")
    p.add_argument("--max-prefill-graph-context", type=int, default=32768,
                   help="prompts on up to this many cached tokens (prefix-cache hits) join such steps (0: off)")
    p.add_argument("--prefill-graph-context-decodes", action=argparse.BooleanOptionalAction, default=True,
                   help="... after decode rows too (another user's next turn while others decode)")
    p.add_argument("--max-graph-batch", type=_positive_int, default=256, help="largest decode batch captured as a CUDA graph")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="priority: requests' priority (lower first) orders admission, scheduling and preemption")
    p.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto",
                   help="overlap the host's scheduling and output processing with the GPU's step "
                        "(auto: on CUDA)")


def engine_config_from_args(args: argparse.Namespace):
    from .engine.engine import EngineConfig

    return EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                       max_model_len=args.max_model_len, page_size=args.page_size, cache_memory=args.cache_memory,
                       gpu_memory_utilization=args.gpu_memory_utilization,
                       unified_memory=not args.no_unified_memory, kda_fraction=args.kda_fraction,
                       enable_prefix_caching=args.enable_prefix_caching, prefix_block_size=args.prefix_block_size,
                       kda_checkpoint_interval=args.kda_checkpoint_interval,
                       tensor_parallel_size=args.tensor_parallel_size, expert_parallel_size=args.expert_parallel_size,
                       decode_context_parallel_size=args.decode_context_parallel_size,
                       decode_graphs="off" if args.enforce_eager else "auto", max_graph_batch=args.max_graph_batch,
                       prefill_graphs="off" if args.enforce_eager or args.max_prefill_graph_tokens < 2 else "auto",
                       max_prefill_graph_tokens=max(args.max_prefill_graph_tokens, 2),
                       max_prefill_graph_decodes=args.max_prefill_graph_decodes,
                       max_prefill_graph_context=args.max_prefill_graph_context,
                       prefill_graph_context_decodes=args.prefill_graph_context_decodes,
                       async_scheduling=args.async_scheduling, scheduling_policy=args.scheduling_policy)


def engine_from_args(args: argparse.Namespace):
    from .engine.engine import LLMEngine

    cfg = engine_config_from_args(args)
    return LLMEngine.from_pretrained(args.model, preset=args.preset, config=cfg, load_format=args.load_format,
                                     dtype=args.dtype, device=args.device, seed=args.weights_seed,
                                     verify_checksums=args.verify_checksums, quantization=args.quantization)


def _generate(args: argparse.Namespace) -> int:
    from .engine.engine import LLM
    from .engine.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=args.stop or [],
                            ignore_eos=args.ignore_eos)  # (a bad value: main's one-line error)
    prompts = list(args.prompts)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("error: give a prompt (or --prompts-file)", file=sys.stderr)
        return 2
    engine = engine_from_args(args)
    if args.token_ids:
        prompts = [[int(t) for t in p.replace(",", " ").split()] for p in prompts]
    elif engine.tokenizer is None:
        print("error: this model has no tokenizer; pass --token-ids and space-separated ids", file=sys.stderr)
        return 2
    if len(prompts) == 1 and args.n == 1:  # stream to the terminal as tokens arrive
        engine.add_request(prompts[0], params)
        out = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                o = out.outputs[0]
                sys.stdout.write(o.delta_text if engine.tokenizer else "".join(f"{t} " for t in o.delta_token_ids))
                sys.stdout.flush()
        print(f"\n[{out.outputs[0].finish_reason}, {len(out.outputs[0].token_ids)} tokens]", file=sys.stderr)
        return 0
    llm = LLM.from_engine(engine)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    for out in outs:
        for o in out.outputs:
            print(f"--- {out.request_id}[{o.index}] ({o.finish_reason}) ---")
            print(o.text if engine.tokenizer else o.token_ids)
    n_tok = sum(len(o.token_ids) for out in outs for o in out.outputs)
    print(f"{len(outs)} requests, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.1f} tok/s)", file=sys.stderr)
    return 0


def _plan(args: argparse.Namespace) -> int:
    import json

    from .config import ModelConfig
    from .plan import format_plan, make_plan
    from .presets import preset_config
    from .cache.pool import parse_bytes

    cfg = ModelConfig.from_pretrained(resolve_model(args.model)) if args.model else ModelConfig.from_dict(preset_config(args.preset))
    cfg = cfg.with_quantization(args.quantization)
    plan = make_plan(cfg, args.gpus, parse_bytes(args.gpu_memory) / 2**30, nodes=args.nodes,
                     context=_parse_tokens(args.context), concurrency=args.concurrency, reserve_gib=args.reserve_gib,
                     hash_block=args.prefix_block_size, checkpoint_interval=args.kda_checkpoint_interval,
                     name=args.model or args.preset)
    print(json.dumps(plan.to_dict(), indent=1) if args.json else format_plan(plan))
    return 0


def _parse_tokens(text: str) -> int:
    """'1M' -> 1048576, '128K' -> 131072, '1G' -> 2^30, '5000' -> 5000."""
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def _serve(args: argparse.Namespace) -> int:
    from .serve.server import serve

    return serve(args)  # (LayoutError, CheckpointError, ... raised in the engine process too: main's error line)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3serve", description="Serving engine for the Kimi K3 model family")
    sub = p.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate from prompts (one prompt streams to the terminal)")
    add_engine_args(gen, model_required=False)
    gen.add_argument("prompts", nargs="*")
    gen.add_argument("--prompts-file", help="one prompt per line")
    gen.add_argument("--token-ids", action="store_true", help="prompts are space-separated token ids")
    gen.add_argument("--max-tokens", type=_positive_int, default=64, help="tokens to generate a sample (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="default 0: greedy, so -n samples agree unless a temperature is given (SamplingParams' "
                          "default is 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="default 0: off")
    gen.add_argument("--min-p", type=float, default=0.0, help="default 0: off")
    gen.add_argument("--seed", type=int, default=None, help="reproducible sampling")
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("-n", type=_positive_int, default=1, help="samples a prompt (default 1)")
    gen.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens past the end of text")
    gen.set_defaults(func=_generate)

    pl = sub.add_parser("plan", help="legal parallel layouts, memory budget and cache capacity")
    src = pl.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory or bundled model name (only config.json is read)")
    src.add_argument("--preset", choices=list(PRESETS))
    pl.add_argument("--gpus", type=_positive_int, required=True)
    pl.add_argument("--gpu-memory", required=True, help="usable memory per GPU, e.g. 80GiB or 80GB")
    pl.add_argument("--nodes", type=_positive_int, default=1)
    pl.add_argument("--context", default="128K", help="context length per request, e.g. 1M")
    pl.add_argument("--concurrency", type=_positive_int, default=32)
    pl.add_argument("--reserve-gib", type=float, default=8.0, help="runtime reserve (activations, graphs, framework)")
    pl.add_argument("--prefix-block-size", type=_positive_int, default=512)
    pl.add_argument("--kda-checkpoint-interval", type=_positive_int, default=4096)
    pl.add_argument("--json", action="store_true")
    add_quantization_arg(pl)
    pl.set_defaults(func=_plan)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (default: the bundled model)")
    add_engine_args(sv, model_required=False)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--api-key", default=os.environ.get("K3SERVE_API_KEY"))
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--max-queue", type=int, default=None, help="waiting requests beyond this get HTTP 503")
    sv.add_argument("--burst-gap-ms", type=float, default=None,
                    help="an idle engine's first request waits while more arrive this close together (at most 20 "
                         "ms), so a burst is prefilled in one step; a wait that finds none stops the waits until "
                         "requests come in bursts again (a lone client pays it once); default 5, 0: never wait")
    sv.add_argument("--reasoning-parser", choices=["kimi_k3"], default=None)
    sv.add_argument("--tool-call-parser", choices=["kimi_k3", "kimi_k2"], default=None)
    sv.add_argument("--tool-call-text-limit", type=_positive_int, default=None, metavar="N",
                    help="tool_choice required / named on K3: at most N characters of reasoning, response and "
                         "each string argument (default: unbounded; for weak models that may never reach the call)")
    sv.add_argument("--no-structured-output", action="store_true")
    sv.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                    help="sampling settings a request omits (temperature, top_p, top_k, min_p, repetition_penalty, "
                         "max_new_tokens as max_tokens' default) from the model's generation_config.json (auto), "
                         "from DIR's, or none (vllm), as vLLM")
    sv.add_argument("--override-generation-config", type=_json_object, default=None, metavar="JSON",
                    help='e.g. \'{"temperature": 0.6}\': over the generation config\'s')
    sv.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help='logprobs name tokens "token_id:N", not by their text (which may be a partial character); '
                         "a request's return_tokens_as_token_ids overrides it")
    sv.add_argument("--log-level", default="info")
    sv.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="load a running server (TTFT / TPOT / ITL / E2E, throughput)")
    from .bench_serve import add_args as _bench_args, main as _bench_main

    _bench_args(bs)
    bs.set_defaults(func=_bench_main)

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
    ck.add_argument("--prompt-len", type=_positive_int, default=32)
    ck.add_argument("--steps", type=_positive_int, default=8)
    ck.add_argument("--verify-checksums", action="store_true")
    add_quantization_arg(ck)
    ck.set_defaults(func=_check)
    return p


def main(argv: list[str] | None = None) -> int:
    """Bad input (a flag's value, a model directory, a checkpoint, a layout, a prompt, an unreachable
    server) ends in one line ``error: ...`` and exit 2, not a traceback (K3SERVE_TRACEBACK=1 shows it)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # ConfigError, CheckpointError, LayoutError, RequestRejected among them
        if os.environ.get("K3SERVE_TRACEBACK"):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if type(exc).__module__.startswith("httpx") and not os.environ.get("K3SERVE_TRACEBACK"):
            print(f"error: {exc}", file=sys.stderr)  # (bench serve: the server is not there)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())

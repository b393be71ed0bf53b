"""Where an engine start's seconds go: kimi-linear-48b (dummy weights) built as bench.e2e builds it,
with timers around the phases that can take long: Triton's autotuner timing candidate configs
(their compiles included), every Triton compile (inside the autotuner or not), the pool's
activation-peak step, CUDA-graph capture and the prefill graphs' timing pass. Nested phases count
in each (a compile inside the autotuner is in both rows). On a fresh machine every Triton kernel
compiles and tunes (cold cache); run it twice on one machine to see a warm start. Stopped by a
timeout (SIGTERM), it still prints what it had (a phase still running counts up to then).

    python3 -m bench.start_profile [--max-model-len 33280] [--max-seqs 2] [--max-num-batched-tokens N]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import signal
import sys
import time
from collections import defaultdict

# (module, attribute path, label): the callables timed
PHASES = [("triton.runtime.autotuner", "Autotuner._bench", "autotune: timing a candidate config"),
          ("triton.compiler.compiler", "compile", "Triton compile"),
          ("k3serve.model.loader", "load_model", "weights"),
          ("k3serve.engine.engine", "LLMEngine._profile_gpu_pool_bytes", "pool: activation-peak step"),
          ("k3serve.engine.decode_graphs", "capture_graphs", "CUDA-graph capture"),
          ("k3serve.engine.prefill_graphs", "PrefillGraphs.time_all", "prefill graphs: timing pass")]

totals: dict[str, float] = defaultdict(float)
counts: dict[str, int] = defaultdict(int)
running: dict[str, float] = {}


def timed(label: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        outer = label not in running  # (recursion counts once)
        if outer:
            running[label] = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            if outer:
                totals[label] += time.perf_counter() - running.pop(label)
                counts[label] += 1
    return wrapper


def install() -> None:
    for m in ("k3serve.engine.engine", "k3serve.engine.prefill_graphs", "triton.runtime.jit"):
        importlib.import_module(m)  # (modules that import a timed function by name, rebound below)

    wrapped = {}
    for module, path, label in PHASES:
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for p in parents:
            owner = getattr(owner, p)
        original = getattr(owner, name)
        setattr(owner, name, timed(label, original))
        if not parents:
            wrapped[id(original)] = getattr(owner, name)
    # modules that imported a timed function by name hold the original: point them at the timer
    for mod_name, mod in list(sys.modules.items()):
        if mod is not None and mod_name.startswith(("k3serve.", "triton.")):
            for attr, value in list(vars(mod).items()):
                if id(value) in wrapped:
                    setattr(mod, attr, wrapped[id(value)])


def report(wall: float) -> None:
    now = time.perf_counter()
    print(f"\nengine start: {wall:.1f} s wall\n| phase | calls | s |\n|---|---|---|")
    for _, _, label in PHASES:
        extra = now - running[label] if label in running else 0.0
        print(f"| {label}{' (still running)' if extra else ''} | {counts[label]} | {totals[label] + extra:.1f} |")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-model-len", type=int, default=33280)
    ap.add_argument("--max-seqs", type=int, default=2)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    install()
    from .e2e import engine_48b

    def stop(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    extra = {} if args.max_num_batched_tokens is None else {"max_num_batched_tokens": args.max_num_batched_tokens}
    try:
        engine_48b(args.max_seqs, args.max_model_len, "auto", **extra)
    except KeyboardInterrupt:
        print("stopped before the engine was up", file=sys.stderr)
    finally:
        report(time.perf_counter() - t0)


if __name__ == "__main__":
    main()

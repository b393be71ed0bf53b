"""Tune every autotuned kernel the engine reaches on this GPU and write the shipped results file
(k3serve/ops/tuned_configs.py): per preset and max_model_len, an engine is built (its pool sizing
step, decode and prefill graph capture) and serves a small mix of prompts and decode batches, so
the keys a server of that shape meets are tuned; then the autotuners' choices are written to
``--out`` (default: the package's tuned/ directory, named for this device and Triton version).
Starts from nothing: K3SERVE_TUNED_CONFIGS=0 here, so no earlier file is applied (Triton's own
on-disk autotune cache still answers keys this machine tuned before, with the same choices).
``--merge``: the shipped file is applied first, so only the keys it lacks are tuned (a kernel whose
key changed since: kimi-linear's MLA prefill writing a bf16 output had only fp32-output entries,
so it tuned on every fresh machine and its tiles, and so its bits, followed that machine's
timing); the file written keeps the shipped entries and adds (or replaces) the tuned ones.

    python3 -m bench.tune_configs [--presets kimi-linear-48b,k3-slice] [--max-model-lens 33280,1048576]
                                  [--out FILE] [--merge]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

if "--merge" not in sys.argv:
    os.environ["K3SERVE_TUNED_CONFIGS"] = "0"

import torch  # noqa: E402

from k3serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.ops import tuned_configs  # noqa: E402


def serve_mix(eng: LLMEngine, rng: torch.Generator) -> int:
    """Prompts alone at several lengths (chunked where long), then decode batches of several
    sizes; returns the steps run."""
    vocab = eng.model.config.vocab_size - 300
    steps = 0

    def run(lens: list[int], new: int) -> None:
        nonlocal steps
        params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
        for n in lens:
            eng.add_request(torch.randint(0, vocab, (n,), generator=rng).tolist(), params)
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1

    for n in (7, 100, 700, 3000, eng.config.max_num_batched_tokens + 500):
        run([min(n, eng.max_model_len - 8)], 2)
    for batch in (1, 3, 16, 64, min(256, eng.config.max_num_seqs)):
        run([64] * batch, 6)
    return steps


def merge(path: Path, shipped: dict) -> int:
    """The file at ``path`` (just dumped) with every ``shipped`` entry whose key it lacks added back
    (entries of kernels this run never loaded, keys it never reached); returns the entries."""
    data = json.loads(path.read_text())
    kernels, new = data["kernels"], 0
    for name, entries in shipped.items():
        have = {json.dumps(e["key"]) for e in kernels.get(name, [])}
        kept = [e for e in entries if json.dumps(e["key"]) not in have]
        kernels[name] = sorted(kernels.get(name, []) + kept, key=lambda e: json.dumps(e["key"]))
    for name, entries in kernels.items():
        before = {json.dumps(e["key"]) for e in shipped.get(name, [])}
        new += sum(json.dumps(e["key"]) not in before for e in entries)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"merged: {new} entries new to the shipped file", flush=True)
    return sum(len(v) for v in kernels.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-linear-48b,k3-slice")
    # (max_model_len moves few keys: the MLA split step at 512 + 64 latent widths is the untuned Gluon
    # kernel; the Triton one keys on the table's width)
    ap.add_argument("--max-model-lens", default="33280")
    ap.add_argument("--out", default=None, help="file to write (default: the package's file for this device)")
    ap.add_argument("--merge", action="store_true", help="tune only the keys the shipped file lacks; keep its entries")
    args = ap.parse_args()
    device_name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else tuned_configs.file_for(device_name)
    shipped = json.loads(tuned_configs.file_for(device_name).read_text())["kernels"] if args.merge else {}
    rng = torch.Generator().manual_seed(0)
    for preset, max_len in itertools.product(args.presets.split(","), map(int, args.max_model_lens.split(","))):
        t0 = time.perf_counter()
        eng = LLMEngine.from_pretrained(None, preset=preset, dtype="bfloat16", device="cuda", load_format="dummy",
                                        config=EngineConfig(max_model_len=max_len))
        started = time.perf_counter() - t0
        steps = serve_mix(eng, rng)
        del eng
        gc.collect()
        torch.cuda.empty_cache()
        written = tuned_configs.dump(out, device_name)  # after each engine: a run cut later keeps what it had
        if shipped:
            written = merge(out, shipped)
        print({"preset": preset, "max_model_len": max_len, "engine_start_s": round(started, 1), "steps": steps,
               "total_s": round(time.perf_counter() - t0, 1), "tuned_keys_written": written, "file": str(out)},
              flush=True)


if __name__ == "__main__":
    main()

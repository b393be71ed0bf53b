"""Tune every autotuned kernel the engine reaches on this GPU and write the shipped results file
(k3serve/ops/tuned_configs.py): per preset and max_model_len, an engine is built (its pool sizing
step, decode and prefill graph capture) and serves a small mix of prompts and decode batches, so
the keys a server of that shape meets are tuned; then the autotuners' choices are written to
``--out`` (default: the package's tuned/ directory, named for this device and Triton version).
Starts from nothing: K3SERVE_TUNED_CONFIGS=0 here, so no earlier file is applied (Triton's own
on-disk autotune cache still answers keys this machine tuned before, with the same choices).

    python3 -m bench.tune_configs [--presets kimi-linear-48b,k3-slice] [--max-model-lens 33280,1048576]
                                  [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import time
from pathlib import Path

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="kimi-linear-48b,k3-slice")
    # (max_model_len moves few keys: the MLA split step at 512 + 64 latent widths is the untuned Gluon
    # kernel; the Triton one keys on the table's width)
    ap.add_argument("--max-model-lens", default="33280")
    ap.add_argument("--out", default=None, help="file to write (default: the package's file for this device)")
    args = ap.parse_args()
    device_name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else tuned_configs.file_for(device_name)
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
        print({"preset": preset, "max_model_len": max_len, "engine_start_s": round(started, 1), "steps": steps,
               "total_s": round(time.perf_counter() - t0, 1), "tuned_keys_written": written, "file": str(out)},
              flush=True)


if __name__ == "__main__":
    main()

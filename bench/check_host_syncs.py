"""GPU check: no host sync inside a forward step (CUDA only; not a CI test).

A sync in the forward stops the host until the GPU catches up, so the launches that follow it run
with the GPU idle: ``state[slots] = 0.0`` in fla_backend._zero_fresh did that in every KDA layer of
an eager step that mixed new and continuing prompts (RESULTS.md thirty-fifth session). This runs an
engine's steps (decode rows, prompts continuing from an earlier chunk, new prompts, eager and
static) once to compile and tune, then the same workload again with every ``runner.execute`` under
``torch.cuda.set_sync_debug_mode("error")``: any synchronising call in the forward raises there,
and is printed with its stack.

  python3 bench/check_host_syncs.py [--preset tiny|kimi-linear-48b]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("K3SERVE_BACKEND", "triton")

from k3serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from k3serve.engine.sampling_params import SamplingParams  # noqa: E402
from k3serve.ops import fla_backend  # noqa: E402


def workload(eng: LLMEngine, seed: int) -> tuple[int, list[list[int]]]:
    """Four requests decoding, then three 300-token prompts arriving under a 384-token step budget
    (so prompts continue across steps next to decode rows and new prompts). Returns the steps and
    the greedy answers, in request order."""
    rng = random.Random(seed)
    vocab = eng.model.config.vocab_size - 300
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for _ in range(4):
        eng.add_request([rng.randrange(vocab) for _ in range(rng.randrange(20, 60))], greedy)
    steps, done = 0, {}

    def step():
        nonlocal steps
        steps += 1
        done.update((o.request_id, o.outputs[0].token_ids) for o in eng.step() if o.finished)

    for _ in range(3):
        step()
    for _ in range(3):
        eng.add_request([rng.randrange(vocab) for _ in range(300)], greedy)
    while eng.has_unfinished_requests():
        step()
    return steps, [list(done[r]) for r in sorted(done, key=lambda r: int(r.rsplit("-", 1)[1]))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself (nothing is checked)")
    args = ap.parse_args()
    eng = LLMEngine.from_pretrained(None, preset=args.preset, dtype="bfloat16", device=args.device,
                                    load_format="dummy", config=EngineConfig(
                                        max_num_seqs=16, max_model_len=2048, max_num_batched_tokens=384,
                                        enable_prefix_caching=False))  # the second run must not hit the first
    workload(eng, 0)  # compiles, tunes, captures
    execute = eng.runner.execute
    failures: list[str] = []

    cuda = eng.device.type == "cuda"
    mode = torch.cuda.set_sync_debug_mode if cuda else (lambda _: None)

    def checked(*a, **k):
        mode("error")
        try:
            return execute(*a, **k)
        except RuntimeError as exc:
            failures.append("".join(traceback.format_exception(exc)[-12:]))
            mode("default")
            return execute(*a, **k)  # finish the step; the failure is reported
        finally:
            mode("default")

    eng.runner.execute = checked
    steps, answers = workload(eng, 0)
    kinds = eng.step_kinds()
    print(f"{args.preset}: {steps} steps checked ({kinds}); forwards that synchronised the host: {len(failures)}")
    for f in failures[:3]:
        print(f)
    # The same greedy answers with fla's public chunk_kda (its own chunk indices; fla_backend's
    # direct call and the batch's host-built indices off), where that backend runs.
    eng.runner.execute = execute
    fla_backend.DIRECT_FORWARD = False
    same = workload(eng, 0)[1] == answers
    print(f"greedy answers with fla's public chunk_kda: {'the same' if same else 'DIFFERENT'} ({len(answers)} requests)")
    print("host-sync check:", "dry run on CPU, nothing checked" if not cuda else "ok" if not failures else "FAIL")
    return 1 if failures or not same else 0


if __name__ == "__main__":
    sys.exit(main())

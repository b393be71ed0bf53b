"""All kernel checks and timings in one run on the GPU: ``python -m bench.kernels [--no-sweep]``.

Runs the KDA decode, KDA prefill, MLA decode, MLA prefill, routed-expert and small-kernel scripts
(each checks against the plain-torch reference first, then times against the copy / matmul ceilings
measured in the same run, with fla side by side where it has the op), each printing its own detailed
tables, then one table of every script's headline rows (``bench.summary``): kernel, shape, time,
TB/s or TFLOP/s, % of the ceiling measured at the end of this run, and the reference op's time beside
it. ``--no-sweep`` skips the MLA and MoE tile sweeps. Cut short by SIGTERM (``timeout``), it still prints
the table of the scripts that finished. Record the printed tables in bench/RESULTS.md.
"""

from __future__ import annotations

import signal
import sys

from . import kernels_kda_decode, kernels_kda_prefill, kernels_mla, kernels_mla_prefill, kernels_moe, kernels_small
from .ceilings import copy_tbs, matmul_tflops
from .summary import table

SCRIPTS = (("KDA decode", kernels_kda_decode), ("KDA prefill (fla, FlashKDA)", kernels_kda_prefill),
           ("MLA decode", kernels_mla), ("MLA prefill", kernels_mla_prefill), ("routed experts", kernels_moe),
           ("norms, routing, expert alignment, AttnRes", kernels_small))


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    failed, rows = [], []
    signal.signal(signal.SIGTERM, _interrupt)
    for name, mod in SCRIPTS:
        print(f"\n## {name}\n", flush=True)
        try:
            rows += mod.main() or []
        except KeyboardInterrupt:
            print(f"cut short in {name}: the table below has the scripts before it", flush=True)
            failed.append(f"{name} (cut short)")
            break
        except Exception as exc:  # one broken kernel must not hide the others' figures
            print(f"{name} failed: {exc!r}", flush=True)
            failed.append(name)
    print("\n## one table\n\n" + table(rows, copy_tbs(), matmul_tflops()), flush=True)
    if failed:
        print("failed:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

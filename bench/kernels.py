"""All kernel checks and timings in one run on the GPU: ``python -m bench.kernels``.

Runs the MLA decode, KDA decode, routed-expert and small-kernel scripts (each checks against the plain-torch
reference first, then times against the copy / matmul ceilings measured in the same run, with
fla side by side where it has the op). Record the printed tables in bench/RESULTS.md.
"""

from __future__ import annotations

import sys

from . import kernels_kda_decode, kernels_mla, kernels_moe, kernels_small


def main() -> int:
    failed = []
    for name, mod in (("KDA decode", kernels_kda_decode), ("MLA decode", kernels_mla), ("routed experts", kernels_moe),
                      ("norms, routing, expert alignment, AttnRes", kernels_small)):
        print(f"\n## {name}\n", flush=True)
        try:
            mod.main()
        except Exception as exc:  # one broken kernel must not hide the others' figures
            print(f"{name} failed: {exc!r}", flush=True)
            failed.append(name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

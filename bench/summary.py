"""The one table of ``python -m bench.kernels``: a row per kernel and shape as the model calls it,
with its time, the rate it reaches, that rate as a fraction of the ceiling that bounds it (copy for
memory-bound kernels, bf16 matmul for compute-bound ones, both measured in the same run), and the
reference library's op timed beside it where one exists (fla for KDA, torch otherwise).

Each kernel script's ``main`` returns its rows; their own detailed tables stay as they were."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    work: float = 0.0  # a call's bytes (bound "copy") or FLOPs (bound "matmul"); 0: latency-bound, no rate
    bound: str = "copy"
    ref: str = ""  # the op timed beside it
    ref_ms: float = math.nan
    check: str = ""  # its correctness figure against the plain-torch reference (or the reference library)

    def rate(self) -> float:
        """TB/s or TFLOP/s: work / ms / 1e9 either way."""
        return self.work / self.ms / 1e9 if self.work and self.ms > 0 else math.nan


def table(rows: list[Row], copy_tbs: float, matmul_tflops: float) -> str:
    """Markdown table of ``rows`` against the ceilings measured in this run."""
    lines = [f"ceilings this run: copy {copy_tbs:.2f} TB/s, bf16 matmul {matmul_tflops:.0f} TFLOP/s", "",
             "| kernel | shape | ms | achieved | % of ceiling | beside it | its ms | speed-up | check |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rate = r.rate()
        if math.isnan(rate):
            achieved = pct = "-"
        elif r.bound == "copy":
            achieved, pct = f"{rate:.2f} TB/s", f"{100 * rate / copy_tbs:.0f} % of copy"
        else:
            achieved, pct = f"{rate:.0f} TFLOP/s", f"{100 * rate / matmul_tflops:.0f} % of matmul"
        has_ref = r.ref and not math.isnan(r.ref_ms)
        lines.append(f"| {r.kernel} | {r.shape} | {r.ms:.4f} | {achieved} | {pct} | {r.ref or '-'} | "
                     f"{f'{r.ref_ms:.4f}' if has_ref else '-'} | {f'{r.ref_ms / r.ms:.2f}x' if has_ref else '-'} | "
                     f"{r.check or '-'} |")
    return "\n".join(lines)

"""One way to autotune a Triton kernel here: the candidate configs on the GPU, a single one under
Triton's CPU interpreter (TRITON_INTERPRET=1, the CI tests), where timing means nothing and every
extra config would only re-run the kernel."""

from __future__ import annotations

import os

import triton


def interpreted() -> bool:
    """Whether Triton kernels run on its CPU interpreter (no inline PTX, timing meaningless)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def autotuned(kernel, candidates: list, interpreted_config, key: list[str], prune=None):
    """``kernel`` wrapped by triton.autotune over ``candidates`` (``interpreted_config`` alone when
    interpreting), keyed on the argument names ``key``; ``prune`` filters configs per call."""
    configs = [interpreted_config] if interpreted() else candidates
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune} if prune else None)(kernel)

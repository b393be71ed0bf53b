"""One way to autotune a Triton kernel here: the candidate configs on the GPU, a single one under
Triton's CPU interpreter (TRITON_INTERPRET=1, the CI tests), where timing means nothing and every
extra config would only re-run the kernel."""

from __future__ import annotations

import os

import triton


def autotuned(kernel, candidates: list, interpreted, key: list[str], prune=None):
    """``kernel`` wrapped by triton.autotune over ``candidates`` (``interpreted`` alone when
    interpreting), keyed on the argument names ``key``; ``prune`` filters configs per call."""
    configs = [interpreted] if os.environ.get("TRITON_INTERPRET") == "1" else candidates
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune} if prune else None)(kernel)

"""One way to autotune a Triton kernel here: the candidate configs on the GPU, a single one under
Triton's CPU interpreter (TRITON_INTERPRET=1, the CI tests), where timing means nothing and every
extra config would only re-run the kernel."""

from __future__ import annotations

import functools
import inspect
import os

import torch
import triton


def interpreted() -> bool:
    """Whether Triton kernels run on its CPU interpreter (no inline PTX, timing meaningless)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# Tuning results are kept on disk (Triton >= 3.4, its cache directory), so a restarted server, or a
# CUDA-graph capture of a new bucket in a later process, reuses them instead of re-timing every
# config of every kernel and shape (the tiny model's first all-Triton run spent ~2 minutes
# compiling and tuning on the H200); it also makes the chosen tiles, and so the numerics, the same
# from one process to the next.
_CACHE_RESULTS = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (an H200's 132 off the GPU: grid-shape rules in the
    CPU tests then pick what they would on the device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def autotuned(kernel, candidates: list, interpreted_config, key: list[str], prune=None):
    """``kernel`` wrapped by triton.autotune over ``candidates`` (``interpreted_config`` alone when
    interpreting), keyed on the argument names ``key``; ``prune`` filters configs per call."""
    configs = [interpreted_config] if interpreted() else candidates
    return triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": prune} if prune else None,
                           **_CACHE_RESULTS)(kernel)

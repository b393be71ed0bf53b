"""fla-core (flash-linear-attention) kernels for KDA on CUDA; optional dependency."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def available() -> bool:
    try:
        import fla.ops.kda  # noqa: F401
    except Exception:
        return False
    return True

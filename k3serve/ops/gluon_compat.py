"""Gluon names that moved between Triton 3.6 (the device's) and 3.9 (CI's): one place for both."""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# cp.async into shared memory: 3.6 async_copy_global_to_shared, 3.9 async_load
async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# a CTA-wide barrier: 3.6 thread_barrier, 3.9 barrier
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


def _tma_load():
    from triton.experimental.gluon.language.nvidia.hopper import tma

    # a TMA tensor copy into shared memory on an mbarrier: 3.6 async_copy_global_to_shared, 3.9 async_load
    return getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


tma_load = _tma_load()

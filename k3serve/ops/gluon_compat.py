"""Gluon names that moved between Triton 3.6 (the device's) and 3.9 (CI's): one place for both."""

from triton.experimental import gluon
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


@gluon.jit
def gluon_pdl_wait(USE_PDL: gl.constexpr):
    """Wait for the previous kernel's completion and memory (Gluon has no ``gdc_*`` builtins in 3.6)."""
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def gluon_pdl_launch_dependents(USE_PDL: gl.constexpr):
    """Let the next kernel launch (once every program of this one has said so or exited)."""
    if USE_PDL:
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def gluon_pdl_start(USE_PDL: gl.constexpr):
    """``pdl.pdl_start`` for Gluon kernels: wait for the previous kernel, then let the next one launch."""
    gluon_pdl_wait(USE_PDL)
    gluon_pdl_launch_dependents(USE_PDL)

"""The GLU activation of the dense MLPs and shared experts in one Triton pass: the torch form is
5 launches for SiLU-GLU and ~10 for K3's SiTU-GLU (casts, tanh, sigmoid, products, cast back),
per MLP per step. ``glu`` is also the epilogue of the routed experts' grouped GEMM, and with the
plain sigmoid it applies MLA's output gate (4 launches over fp32 rows in torch).

Reference: ``model.layers.glu_activation`` (same contract). Checked on CPU with
``TRITON_INTERPRET=1`` (tests/test_glu_triton.py). On CUDA with the Triton backend for GLU
(ops/backend.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import pdl_start


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def glu(a, b, beta, linear_beta, SITU: tl.constexpr, LINEAR_CLIP: tl.constexpr, SIGMOID: tl.constexpr):
    """fp32 a (gate), b (up) -> silu(a) * b, or SiTU-GLU: beta tanh(a / beta) sigmoid(a) times b,
    b clipped to linear_beta tanh(b / linear_beta) when LINEAR_CLIP; or the plain sigmoid gate
    sigmoid(a) * b (SIGMOID: MLA's output gate)."""
    if SIGMOID:
        y = tl.sigmoid(a) * b
    elif SITU:
        if LINEAR_CLIP:
            b = linear_beta * _tanh(b / linear_beta)
        y = beta * _tanh(a / beta) * tl.sigmoid(a) * b
    else:
        y = a * tl.sigmoid(a) * b
    return y


@triton.jit
def _glu_kernel(G, U, Y, n_cols, stride_g, stride_u, stride_y, beta, linear_beta,
                SITU: tl.constexpr, LINEAR_CLIP: tl.constexpr, SIGMOID: tl.constexpr, BLOCK: tl.constexpr,
                SPLIT: tl.constexpr = 1, USE_PDL: tl.constexpr = False):
    """Output row r from gate / up rows r * SPLIT .. r * SPLIT + SPLIT - 1, summed in that order
    (SPLIT > 1: a split-K GEMM's fp32 partials)."""
    pdl_start(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    a = tl.load(G + row * SPLIT * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(U + row * SPLIT * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        a += tl.load(G + (row * SPLIT + s) * stride_g + cols, mask=mask, other=0.0)
        b += tl.load(U + (row * SPLIT + s) * stride_u + cols, mask=mask, other=0.0)
    y = glu(a, b, beta, linear_beta, SITU, LINEAR_CLIP, SIGMOID)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# Columns a program sums and activates where the rows are a split-K GEMM's partials (a decode step's:
# kimi-linear -q mxfp4 at one token, 9 rows of 6 partials), so the few rows' partials are read by
# more programs at once (RESULTS.md fifty-sixth session).
SPLIT_BLOCK = 128


def glu_triton(gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 1.0,
               linear_beta: float | None = None, split: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """``glu_activation`` in one launch: gate, up [..., I] (rows may be strided, e.g. the two
    halves of one fused gate|up GEMM; the last dim must be dense) -> [..., I] in gate's dtype.
    ``split`` > 1: gate and up are [R * split, I] partial sums (a split-K GEMM's, row r's in rows
    r * split ..), summed in order first: [R, I] into ``out`` (its dtype), or in gate's dtype."""
    if act not in ("silu", "situ", "sigmoid"):
        raise ValueError(f"unknown activation {act!r}")
    n = gate.shape[-1]
    g2, u2 = (t.reshape(-1, n) if t.stride(-1) == 1 else t.contiguous().reshape(-1, n) for t in (gate, up))
    if split < 1 or g2.shape[0] % split or (out is not None and out.shape != (g2.shape[0] // split, n)):
        raise ValueError(f"split={split} must divide the {g2.shape[0]} rows, and out hold their sums "
                         f"[{g2.shape[0] // max(split, 1)}, {n}]")
    rows = g2.shape[0] // split
    if out is None:
        out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if rows:
        block = min(SPLIT_BLOCK if split > 1 else 1024, triton.next_power_of_2(n))
        _glu_kernel[(rows, triton.cdiv(n, block))](
            g2, u2, out, n, g2.stride(0), u2.stride(0), out.stride(0), float(beta), float(linear_beta or 1.0),
            SITU=act == "situ", LINEAR_CLIP=linear_beta is not None, SIGMOID=act == "sigmoid", BLOCK=block,
            SPLIT=split, **pdl.launch(out.device))
    return out.view(gate.shape) if split == 1 else out

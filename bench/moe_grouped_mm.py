"""Routed bf16 experts through torch's grouped GEMM (``torch._grouped_mm``, CUTLASS on Hopper): the
library comparator of ``bench.kernels_moe --grouped-mm`` for our Triton grouped GEMM
(``ops.moe_triton.experts_triton``) at prefill sizes.

The library form has to do in separate passes what our kernel fuses: gather each assignment's token
row in expert order (ours indexes the rows inside the GEMM), write the gate / up outputs and read them
back for the GLU (ours applies it in the GEMM's epilogue), and unsort the rows to sum them (ours
writes the rows in assignment order). ``gate_up``: w1 and w3 stacked [E, 2I, din] once (the weights'
layout the library call wants), else stacked here. Same contract as ``moe_ref.experts_ref`` with the
experts of a ``model.moe.RoutedExperts`` (bf16 only; no host sync).
"""

from __future__ import annotations

import torch

from k3serve.model.layers import glu_activation


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of ``a`` in groups ending at ``offs`` times the groups' ``b`` [G, N, K] transposed."""
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm  # (public from torch 2.10)
    return fn(a, b.transpose(-2, -1), offs=offs)


def expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(assignments in expert order, int32 end offset of each expert's rows among them), with no
    host sync (``bincount`` would sync)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=flat.dtype)
    return order, torch.searchsorted(flat[order], experts, right=True).to(torch.int32)


def stacked_gate_up(experts) -> torch.Tensor:
    return torch.cat([experts.stack("w1")[0], experts.stack("w3")[0]], dim=1).contiguous()


def experts_grouped_mm(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts,
                       gate_up: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, din] bf16, weights / ids [T, top_k]: the routed experts' weighted sum [T, dout] fp32."""
    if experts.mxfp4:
        raise ValueError("torch's grouped GEMM takes bf16 experts only")
    T, top_k = ids.shape
    E = experts.num_experts + experts.num_shared
    order, offs = expert_order(ids, E)
    token = order // top_k
    w13 = stacked_gate_up(experts) if gate_up is None else gate_up
    h = grouped_mm(x.to(w13.dtype)[token], w13, offs)  # [T * top_k, 2I]
    inter = experts.intermediate
    a = glu_activation(h[:, :inter], h[:, inter:], *experts.act)
    y = grouped_mm(a, experts.stack("w2")[0], offs).float() * weights.reshape(-1)[order, None].float()
    return torch.zeros(T, y.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token, y)

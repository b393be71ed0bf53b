"""The routed experts through torch's grouped GEMM (``bench.moe_grouped_mm``, the library comparator
of our Triton grouped GEMM) against the per-expert reference on CPU (torch's CPU grouped GEMM): experts
with no rows, one row, many; SiLU and SiTU GLUs; joined shared experts named by the ids."""

from types import SimpleNamespace

import pytest
import torch

from bench.moe_grouped_mm import experts_grouped_mm, stacked_gate_up
from k3serve.ops.moe_ref import experts_ref


def experts(E: int, shared: int, inter: int, d: int, act: tuple, gen: torch.Generator):
    w = {n: (torch.randn(E + shared, *shape, generator=gen) * shape[1] ** -0.5).bfloat16()
         for n, shape in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter)))}
    ex = SimpleNamespace(num_experts=E, num_shared=shared, mxfp4=False, intermediate=inter, act=act,
                         stack=lambda name: (w[name], None))
    ex.expert = lambda e: tuple(w[n][e] for n in ("w1", "w2", "w3"))
    return ex


@pytest.mark.parametrize("T, E, shared, top_k, act", [
    (1, 8, 0, 2, ("silu", 1.0, None)), (37, 16, 0, 4, ("silu", 1.0, None)),
    (64, 8, 1, 3, ("situ", 3.0, 8.0)), (5, 32, 0, 8, ("situ", 2.0, None))])
def test_grouped_mm_experts_match_reference(T, E, shared, top_k, act):
    gen = torch.Generator().manual_seed(T + E)
    ex = experts(E, shared, 64, 48, act, gen)
    ids = torch.rand(T, E, generator=gen).topk(top_k, dim=-1).indices
    if shared:  # the joined shared expert: the last id of every token
        ids = torch.cat([ids[:, :-1], torch.full((T, 1), E)], dim=1)
    weights = torch.rand(T, top_k, generator=gen)
    x = torch.randn(T, 48, generator=gen).bfloat16()
    ref = experts_ref(x.float(), weights, ids, lambda e: tuple(t.float() for t in ex.expert(e)), *ex.act)
    for gate_up in (None, stacked_gate_up(ex)):
        out = experts_grouped_mm(x, weights, ids, ex, gate_up)
        assert out.dtype == torch.float32 and out.shape == ref.shape
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2  # bf16 operands and bf16 gate / up rows


def test_grouped_mm_refuses_mxfp4_experts():
    ex = SimpleNamespace(mxfp4=True)
    with pytest.raises(ValueError, match="bf16"):
        experts_grouped_mm(torch.zeros(1, 32), torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long), ex)

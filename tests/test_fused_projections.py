"""Fused input projections (model.layers.LinearGroup): after loading, the linears that read the same
input run as one GEMM over one weight tensor whose slices are the parameters themselves."""

import pytest
import torch

from k3serve.model.batch import CacheHandles, ForwardBatch, SeqChunk
from k3serve.model.layers import Linear, LinearGroup
from k3serve.model.loader import load_model

PAGE = 16


def _logits(model, seqs):
    caches = CacheHandles.allocate(model.config, len(seqs), 8 * len(seqs), PAGE, dtype=torch.float32)
    chunks = [SeqChunk(s, 0, i, list(range(8 * i, 8 * i + 8))) for i, s in enumerate(seqs)]
    with torch.inference_mode():
        return model.compute_logits(model(ForwardBatch.build(chunks, PAGE), caches))


def _groups(model):
    return [m for m in model.modules() if isinstance(m, LinearGroup)]


@pytest.mark.parametrize("mxfp4", [False, True])
def test_fused_model_equals_unfused_and_holds_no_second_copy(mxfp4):
    fused = load_model(preset="tiny", dtype="float32", device="cpu", seed=3, mxfp4=mxfp4)
    plain = load_model(preset="tiny", dtype="float32", device="cpu", seed=3, mxfp4=mxfp4)
    for g in _groups(plain):  # undo: every member gets its own storage again, groups run one by one
        g.fused = None
        for o in g._outputs:
            for m in o:
                m.weight.data = m.weight.data.clone()
    for mod in plain.modules():
        if hasattr(mod, "conv_w"):
            mod.conv_w = None
    groups = _groups(fused)
    assert groups and all(g.fused is not None for g in groups)
    kinds = {type(g._outputs[0][0]).__name__ for g in groups}
    assert kinds == {"Linear"} and len(groups) >= fused.config.num_hidden_layers  # KDA, MLA, MLP/shared each
    for g in groups:  # each member's weight is a slice of the fused matrix: one copy in memory
        start, end = g.fused.data_ptr(), g.fused.data_ptr() + g.fused.numel() * g.fused.element_size()
        assert all(start <= m.weight.data_ptr() < end for o in g._outputs for m in o)
    assert set(fused.state_dict()) == set(plain.state_dict())  # no new checkpoint names
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 1700, (n,), generator=gen).tolist() for n in (9, 30, 1)]
    a, b = _logits(fused, seqs), _logits(plain, seqs)
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_member_weights_stay_live_views_after_fusing():
    """An in-place update of a member (a reload, a planted fault) reaches the fused GEMM."""
    torch.manual_seed(0)
    q, k = Linear(8, 4, torch.float32), Linear(8, 6, torch.float32)
    for m in (q, k):
        m.weight.data.normal_()
    g = LinearGroup(q, k)
    x = torch.randn(3, 8)
    before = [t.clone() for t in g(x)]
    g.fuse()
    with torch.inference_mode():
        after = g(x)
    assert all(torch.allclose(u, v, atol=1e-6) for u, v in zip(before, after))
    k.weight.data.mul_(2.0)
    with torch.inference_mode():
        doubled = g(x)[1]
    assert torch.allclose(doubled, 2 * before[1], atol=1e-5)


def test_grouped_outputs_concatenate_and_gradients_reach_members():
    torch.manual_seed(1)
    a, b, c = (Linear(5, n, torch.float32) for n in (2, 3, 4))
    for m in (a, b, c):
        m.weight.data.normal_()
        m.weight.requires_grad_(True)
    g = LinearGroup((a, b), c)
    g.fuse()
    x = torch.randn(7, 5)
    ab, cc = g(x)  # gradients on: members run one by one (the fused tensor is not a parameter)
    assert ab.shape == (7, 5) and torch.allclose(ab, torch.cat([a(x), b(x)], -1))
    (ab.sum() + cc.sum()).backward()
    assert all(m.weight.grad is not None for m in (a, b, c))


def test_row_parallel_linear_cannot_join():
    with pytest.raises(ValueError, match="row-parallel"):
        LinearGroup(Linear(8, 4, torch.float32), Linear(8, 4, torch.float32, tp_dim=1, tp_size=2))

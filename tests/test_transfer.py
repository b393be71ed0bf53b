"""Overlapped scheduling's device-side input fix-up: runs as one slice copy, other layouts by index."""

import pytest
import torch

from k3serve.engine import transfer


@pytest.mark.parametrize("slice_fixup", [True, False])
@pytest.mark.parametrize("dst, src", [([0], [0]), ([3, 4, 5], [1, 2, 3]), ([0, 2, 5], [4, 1, 0]), ([6, 7], [2, 0])])
def test_fill_pending_tokens_matches_the_scatter(monkeypatch, dst, src, slice_fixup):
    monkeypatch.setattr(transfer, "SLICE_FIXUP", slice_fixup)
    tokens = torch.tensor([101, 102, 103, 104, 105])
    input_ids = torch.arange(8) * -1
    expected = input_ids.clone()
    for d, s in zip(dst, src):
        expected[d] = tokens[s]
    transfer.fill_pending_tokens(input_ids, (dst, src, tokens))
    assert input_ids.tolist() == expected.tolist()


def test_runs():
    assert transfer._is_run([4]) and transfer._is_run([2, 3, 4])
    assert not transfer._is_run([2, 4]) and not transfer._is_run([3, 2])


def _staged(n_tokens: int, tail: int, pending: dict[int, int], seed: int) -> torch.Tensor:
    """A staged buffer: n_tokens input tokens, their pending rows (-1 but where ``pending`` says),
    then ``tail`` other entries."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.full((n_tokens,), -1, dtype=torch.int64)
    for d, s in pending.items():
        rows[d] = s
    return torch.cat([torch.randint(0, 1000, (n_tokens,), generator=gen), rows,
                      torch.randint(-1, 1000, (tail,), generator=gen)])


@pytest.mark.parametrize("pending", [{}, {0: 2}, {1: 0, 2: 1, 3: 2}, {0: 4, 5: 1}])
def test_copy_staged_copies_and_takes_the_pending_tokens(pending):
    tokens = torch.tensor([101, 102, 103, 104, 105])
    src = _staged(6, 9, pending, seed=len(pending))
    dst = torch.full((src.numel() + 4,), -7, dtype=torch.int64)
    n = src.numel() - 3  # the last field sent only in part: the rest stays as it was
    transfer.copy_staged(dst, src, n, 6, tokens)
    expected = src[:n].clone()
    for d, s in pending.items():
        expected[d] = tokens[s]
    assert dst[:n].tolist() == expected.tolist()
    assert (dst[n:] == -7).all()


def test_copy_staged_kernel_equals_the_torch_path():
    """The Triton kernel (CPU, through Triton's interpreter) against the torch path, over several
    programs and ragged sizes, int32 tokens into the int64 buffer."""
    pytest.importorskip("triton")
    from interpreted import worst_error

    script = '''
import torch
from k3serve.engine import transfer
gen = torch.Generator().manual_seed(0)
worst = 0
for p, tail, cut in [(3, 5, 0), (40, 2000, 17), (1500, 700, 300)]:
    rows = torch.full((p,), -1, dtype=torch.int64)
    pick = torch.randperm(p, generator=gen)[:max(1, p // 3)]
    tokens = torch.randint(0, 50000, (p,), generator=gen, dtype=torch.int32)
    rows[pick] = torch.randint(0, p, (pick.numel(),), generator=gen)
    src = torch.cat([torch.randint(0, 1000, (p,), generator=gen), rows, torch.randint(-1, 9, (tail,), generator=gen)])
    n = src.numel() - cut
    got, want = torch.full_like(src, -5), torch.full_like(src, -5)
    transfer.copy_staged(got, src, n, p, tokens)
    transfer.interpreted = lambda: False
    transfer.copy_staged(want, src, n, p, tokens)
    transfer.interpreted = lambda: True
    worst = max(worst, int((got != want).sum()))
print(worst)
'''
    assert worst_error(script) == 0

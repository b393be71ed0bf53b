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

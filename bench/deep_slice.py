"""The k3-slice's layers played at K3's depth ([gpu-kernels] item 4: AttnRes under 2 % of a layer).

The slice has K3's widths but only its first four layers, whose mixers see 1 to 3 sources; K3's
deepest layers (84-92) see 8 stored blocks plus the partial. ``install`` swaps the model's
``AttnResState`` for one that starts at layer FIRST_LAYER: the blocks before it already stored
(copies of the embeddings: the mixers' time does not depend on the values) and the slice's layer
indices shifted, so every mixer of a graph-replayed step reads K3's deep source counts (FIRST_LAYER
84: 8, 9, 9, ..., 9) next to real K3-width layers. Bench only: the model code is untouched.

Usage: python3 bench/gpu_check_graphs.py --preset k3-slice --attn-res-depth 84 --parts ab ...
(FIRST_LAYER is a module constant: an --ab variant may set bench.deep_slice.FIRST_LAYER=0.)
"""

from __future__ import annotations

import torch

from k3serve.model import k3
from k3serve.model.attn_res import AttnResState

FIRST_LAYER = 84


class DeepAttnResState(AttnResState):
    """AttnResState from layer ``first`` on (the model's forward passes none: FIRST_LAYER, read at
    construction, one forward pass)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int, num_layers: int, first: int | None = None, **kw):
        self.first = FIRST_LAYER if first is None else first
        if self.first % block_size:  # (the model's block queries are its own blocks': they fit only from a block start)
            kw["block_queries"] = None
        super().__init__(embeddings, block_size, self.first + num_layers, **kw)
        if self.first == 0:
            return
        if self.buffer is None:
            raise ValueError("the deep slice emulates serving (the buffer form) only")
        # blocks 0 .. n-1 stored, slot n the partial of the block in progress (ceil: at a block's
        # first layer that partial is whole and becomes block n there)
        self.n_blocks = -(-self.first // block_size)
        self.buffer[1: self.n_blocks + 1].copy_(embeddings.expand(self.n_blocks, *embeddings.shape))
        # the first layer's owed update (the layer before's output): zeros, made after the copy so
        # that the first mixer's blocks were written two launches back (AttnResState.blocks_ready)
        self.zero = torch.zeros_like(embeddings)

    def token_mixer_sources(self, layer, prev_ffn_out):
        if self.first and layer == 0:
            prev_ffn_out = self.zero
        return super().token_mixer_sources(layer + self.first, prev_ffn_out)

    def channel_mixer_sources(self, layer, attn_out):
        return super().channel_mixer_sources(layer + self.first, attn_out)


def install() -> None:
    """From now on the model's forward builds DeepAttnResState (k3.py looks the name up at each call)."""
    k3.AttnResState = DeepAttnResState


def source_counts(block_size: int, num_layers: int, first: int = FIRST_LAYER) -> list[int]:
    """Each mixer's source count in a forward of ``num_layers`` layers from ``first`` (CPU)."""
    res = DeepAttnResState(torch.zeros(1, 1), block_size, num_layers, first, use_buffer=True, defer=False)
    counts, out = [], torch.zeros(1, 1)
    for i in range(num_layers):
        counts.append(len(res.token_mixer_sources(i, out if i else None)))
        counts.append(len(res.channel_mixer_sources(i, out)))
    return counts + [len(res.final_sources(out))]

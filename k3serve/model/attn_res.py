"""Block Attention Residuals (model-spec §2.7): softmax mixing over depth instead of a residual sum.

Everything here is per token and transient within one forward pass; nothing is cached across steps.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.backend import triton_enabled
from .layers import RMSNorm

# Serving: the partial's update (an add, or a copy at a block start) left to the next mixer, whose
# Triton pass does it while it reads the sources (``attn_res_triton.attn_res_mix``'s
# ``partial_update``) instead of a torch kernel of its own before it: two launches a layer fewer
# and the partial read once. H200, k3-slice graph-replayed decode step (RESULTS.md fourteenth
# session): batch 16 5.727 ms against 5.794, batch 1 2.745 against 2.733 (within the rounds'
# spread, 0.013); the whole-model check's figures bit-identical. False: the torch update.
FUSE_PARTIAL = True


class AttnResMixer(nn.Module):
    """Mix(v) = sum_i softmax_i(w . RMSNorm(v_i; gamma)) v_i, all fp32; the UN-normalised
    sources are mixed. Parameters: pseudo-query ``proj`` [1, d] and key-norm ``norm`` [d]."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None):
        super().__init__()
        self.eps = eps
        self.proj = nn.Parameter(torch.empty(1, dim, dtype=dtype, device=device), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("query", None, persistent=False)  # fp32 [d] once folded (serving)

    def fold_query(self) -> None:
        """Fold the key-norm weight into the pseudo-query once, after loading: the mixers would
        otherwise redo it (three small kernels) at every call. Training never folds."""
        self.query = self.folded_query().detach().contiguous()

    def folded_query(self) -> torch.Tensor:
        return self.query if self.query is not None else self.proj.float()[0] * self.norm.float()

    def forward(self, sources: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0].float()
        v = _stacked(sources).float()  # [m, T, d]
        w = self.folded_query()  # gamma folded into the query
        scores = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + self.eps)  # [m, T]
        alpha = torch.softmax(scores, dim=0)
        return (alpha.unsqueeze(-1) * v).sum(0)

    def mix_and_norm(self, sources: list[torch.Tensor], out_norm: RMSNorm | None,
                     out_dtype: torch.dtype, partial_update: tuple[torch.Tensor, bool] | None = None) -> torch.Tensor:
        """The mix followed by the next sublayer's RMSNorm (None: the final mixer, no norm). On CUDA
        with the Triton backend (ops/backend.py) one fused pass per token. ``partial_update``
        (``AttnResState.take_pending``): (delta, reset) still owed to the last source, the buffer's
        partial slot: added (or, with reset, copied) in that pass, or here first."""
        if (triton_enabled("ATTNRES", sources[0].device) and len(sources) <= 16
                and (out_norm is None or out_norm.eps == self.eps)):
            from ..ops.attn_res_triton import attn_res_mix

            return attn_res_mix(_stacked(sources), self.folded_query(), self.eps,
                                None if out_norm is None else out_norm.weight, out_dtype, partial_update)
        if partial_update is not None:
            delta, reset = partial_update
            (sources[-1].copy_ if reset else sources[-1].add_)(delta)
        mixed = self(sources)
        return mixed.to(out_dtype) if out_norm is None else out_norm(mixed, out_dtype=out_dtype)


def _stacked(sources: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    return sources if isinstance(sources, torch.Tensor) else torch.stack(sources)


class AttnResState:
    """The reference bookkeeping for one forward pass: stored blocks and the running partial,
    the partial rounded to the activation dtype after every addition (bit-close to the reference).

    Serving (autograd off) keeps the blocks and the partial as consecutive slots of one [n, T, d]
    buffer, updated in place, so every mixer's sources are one tensor view: no stack (a copy of all
    sources) per mixer call. Training keeps a list (in-place updates would break autograd)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int, num_layers: int, use_buffer: bool | None = None,
                 defer: bool | None = None):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial = embeddings
        self.buffer = None
        self.n_blocks = 0
        if not torch.is_grad_enabled() if use_buffer is None else use_buffer:
            self.buffer = embeddings.new_empty(-(-num_layers // block_size) + 1, *embeddings.shape)
            self.buffer[0].copy_(embeddings)
        # buffer mode: each partial update may be left to the next mixer (``take_pending``)
        if defer is None:
            defer = FUSE_PARTIAL and triton_enabled("ATTNRES", embeddings.device)
        self.defer = defer and self.buffer is not None
        self.pending: tuple[torch.Tensor, bool] | None = None

    def _add_to_partial(self, x: torch.Tensor) -> None:
        if self.buffer is None:
            self.partial = self.partial + x
        elif self.defer:
            self.pending = (x, False)
        else:
            self.buffer[self.n_blocks].add_(x)

    def take_pending(self) -> tuple[torch.Tensor, bool] | None:
        """The partial update owed to the sources just returned (their last one), for the mixer."""
        pending, self.pending = self.pending, None
        return pending

    def _sources(self, with_partial: bool = True) -> list[torch.Tensor] | torch.Tensor:
        if self.buffer is None:
            return self.blocks + [self.partial] if with_partial else list(self.blocks)
        return self.buffer[: self.n_blocks + with_partial]

    def token_mixer_sources(self, layer: int, prev_ffn_out: torch.Tensor | None) -> list[torch.Tensor] | torch.Tensor:
        if layer > 0:
            self._add_to_partial(prev_ffn_out)
        if layer % self.block_size == 0:  # the partial becomes a stored block (the mixer reads it once)
            if self.buffer is None:
                self.blocks.append(self.partial)
            else:
                self.n_blocks += 1
            return self._sources(with_partial=False)
        return self._sources()

    def channel_mixer_sources(self, layer: int, attn_out: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        if layer % self.block_size == 0:  # a new block's partial starts from the mixer output
            if self.buffer is None:
                self.partial = attn_out
            elif self.defer:
                self.pending = (attn_out, True)
            else:
                self.buffer[self.n_blocks].copy_(attn_out)
        else:
            self._add_to_partial(attn_out)
        return self._sources()

    def final_sources(self, last_ffn_out: torch.Tensor) -> list[torch.Tensor] | torch.Tensor:
        self._add_to_partial(last_ffn_out)
        return self._sources()

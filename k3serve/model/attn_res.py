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
# Serving, a few tokens: at a block's first mixer, where the stored blocks number SUMMARY_MIN_BLOCKS or
# more, one launch mixes them for every mixer of the block at once (``block_summary``; Triton:
# ``attn_res_triton.attn_res_summary``), so the block's later mixers each read that summary row and the
# partial instead of up to 9 sources (K3's deep mixers had split each row between programs that meet
# at a barrier). From 3 blocks (K3's layers 24-92): a k3-slice step played at layers 24 / 36 / 84 spent
# 44.7 / 45.8 / 69.7 us of mixers on its critical path without, 40.7 / 40.2 / 40.7 with; at 2 blocks
# (layer 12) 35.9 against 41.3 (RESULTS.md thirtieth session).
SUMMARY_MIN_BLOCKS = 3


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
                     out_dtype: torch.dtype, partial_update: tuple[torch.Tensor, bool] | None = None,
                     summary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The mix followed by the next sublayer's RMSNorm (None: the final mixer, no norm). On CUDA
        with the Triton backend (ops/backend.py) one fused pass per token. ``partial_update``
        (``AttnResState.take_pending``): (delta, reset) still owed to the last source, the buffer's
        partial slot: added (or, with reset, copied) in that pass, or here first. ``summary``
        (this mixer's row of ``summarize``'s: [T, 2, d], [T]): the stored blocks given by it, the
        sources the partial alone."""
        if self._fused(sources, out_norm):
            from ..ops.attn_res_triton import attn_res_mix

            return attn_res_mix(_stacked(sources), self.folded_query(), self.eps,
                                None if out_norm is None else out_norm.weight, out_dtype, partial_update, summary)
        _update(sources, partial_update)
        if summary is None:
            mixed = self(sources)
        else:
            mixed = summary_mix(*summary, sources[-1].float(), self.folded_query(), self.eps)
        return mixed.to(out_dtype) if out_norm is None else out_norm(mixed, out_dtype=out_dtype)

    def summarize(self, sources: list[torch.Tensor] | torch.Tensor, queries: torch.Tensor, out_norm: RMSNorm | None,
                  out_dtype: torch.dtype, partial_update: tuple[torch.Tensor, bool] | None, summary: torch.Tensor,
                  logits: torch.Tensor) -> torch.Tensor:
        """A block's first mixer (sources: the stored blocks alone) as ``mix_and_norm``, and the
        ``block_summary`` of those blocks for the block's mixers, queries [Q, d] (row 0 this one's),
        written into summary [Q, T, 2, d] (high and low parts in the sources' dtype: at most 2^-16
        of it lost in bf16) and logits [Q, T] (fp32)."""
        if self._fused(sources, out_norm):
            from ..ops.attn_res_triton import attn_res_summary

            return attn_res_summary(_stacked(sources), queries, self.eps, None if out_norm is None else out_norm.weight,
                                    out_dtype, partial_update, summary, logits)
        _update(sources, partial_update)
        mixed, logit = block_summary(_stacked(sources).float(), queries, self.eps)
        high = mixed.to(summary.dtype)
        summary.copy_(torch.stack([high, (mixed - high.float()).to(summary.dtype)], -2))
        logits.copy_(logit)
        return mixed[0].to(out_dtype) if out_norm is None else out_norm(mixed[0], out_dtype=out_dtype)

    def _fused(self, sources, out_norm: RMSNorm | None) -> bool:
        return (triton_enabled("ATTNRES", sources[0].device) and len(sources) <= 16
                and (out_norm is None or out_norm.eps == self.eps))


def block_summary(blocks: torch.Tensor, queries: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [M, T, d] fp32, queries [Q, d] (folded): for each query, the blocks mixed by its
    softmax over them, [Q, T, d], and the log of that softmax's total (logsumexp of the scores),
    [Q, T]. A mixer whose sources are these blocks and one more (the partial) is then the softmax
    over two: the summary row with that logit and the partial with its own score (``summary_mix``)."""
    scores = torch.einsum("qd,mtd->qmt", queries.float(), blocks) * torch.rsqrt(blocks.pow(2).mean(-1) + eps)
    return torch.einsum("qmt,mtd->qtd", torch.softmax(scores, 1), blocks), torch.logsumexp(scores, 1)


def summary_mix(summary: torch.Tensor, logit: torch.Tensor, partial: torch.Tensor, query: torch.Tensor,
                eps: float) -> torch.Tensor:
    """The mix over the summarised blocks (summary [T, 2, d]: high and low parts, logit [T]) and the
    partial [T, d] (fp32)."""
    score = (partial * query).sum(-1) * torch.rsqrt(partial.pow(2).mean(-1) + eps)
    alpha = torch.softmax(torch.stack([logit, score]), 0).unsqueeze(-1)
    return alpha[0] * summary.float().sum(-2) + alpha[1] * partial


def _update(sources, partial_update: tuple[torch.Tensor, bool] | None) -> None:
    if partial_update is not None:
        delta, reset = partial_update
        (sources[-1].copy_ if reset else sources[-1].add_)(delta)


def _stacked(sources: list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    return sources if isinstance(sources, torch.Tensor) else torch.stack(sources)


class AttnResState:
    """The reference bookkeeping for one forward pass: stored blocks and the running partial,
    the partial rounded to the activation dtype after every addition (bit-close to the reference).

    Serving (autograd off) keeps the blocks and the partial as consecutive slots of one [n, T, d]
    buffer, updated in place, so every mixer's sources are one tensor view: no stack (a copy of all
    sources) per mixer call. Training keeps a list (in-place updates would break autograd)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int, num_layers: int, use_buffer: bool | None = None,
                 defer: bool | None = None, block_queries: list[torch.Tensor] | None = None,
                 summarize: bool | None = None):
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
        # block summaries (``mix``): each block's mixers' queries in call order, by the blocks this
        # forward starts (the model's ``attn_res_block_queries``); None (default) / True: the Triton
        # backend's choice / always (the torch reference on CPU: tests)
        if summarize is None:
            summarize = triton_enabled("ATTNRES", embeddings.device)
        self.block_queries = block_queries if summarize and self.buffer is not None else None
        self.blocks_started = 0
        self.block_start = False
        self.summary: tuple[torch.Tensor, torch.Tensor] | None = None
        self.summary_row = 0

    def mix(self, mixer: AttnResMixer, sources: list[torch.Tensor] | torch.Tensor, out_norm: RMSNorm | None,
            out_dtype: torch.dtype) -> torch.Tensor:
        """``mixer`` over ``sources`` (this state's last answer, the mixers called in order), its
        pending partial update included. At a block's first mixer, with enough blocks and few tokens,
        it summarises the blocks for all the block's mixers (``AttnResMixer.summarize``); the block's
        later mixers then read their summary row and the partial alone."""
        pending = self.take_pending()
        if self.block_start:
            self.block_start = False
            queries = self.block_queries[self.blocks_started - 1] if self.block_queries is not None else None
            if queries is not None and self._summarizes(sources, queries):
                T, d = sources.shape[1:]
                self.summary = (sources.new_empty(queries.shape[0], T, 2, d),
                                sources.new_empty(queries.shape[0], T, dtype=torch.float32))
                self.summary_row = 1
                return mixer.summarize(sources, queries, out_norm, out_dtype, pending, *self.summary)
        if self.summary is not None:
            row, self.summary_row = self.summary_row, self.summary_row + 1
            if row >= self.summary[1].shape[0]:
                raise RuntimeError(f"AttnRes: mixer {row} of a block summarised for {self.summary[1].shape[0]}")
            return mixer.mix_and_norm(sources[-1:], out_norm, out_dtype, pending,
                                      (self.summary[0][row], self.summary[1][row]))
        return mixer.mix_and_norm(sources, out_norm, out_dtype, pending)

    def _summarizes(self, sources: torch.Tensor, queries: torch.Tensor) -> bool:
        M, T, d = sources.shape
        if M < SUMMARY_MIN_BLOCKS:
            return False
        if not triton_enabled("ATTNRES", sources.device):
            return True
        from ..ops.attn_res_triton import summary_shape

        return summary_shape(M, queries.shape[0], d, T, sources.device) is not None

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
            self.blocks_started += 1
            self.block_start = True
            self.summary = None
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

"""Block Attention Residuals (model-spec §2.7): softmax mixing over depth instead of a residual sum.

Everything here is per token and transient within one forward pass; nothing is cached across steps.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .layers import RMSNorm


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

    def forward(self, sources: list[torch.Tensor]) -> torch.Tensor:
        if len(sources) == 1:
            return sources[0].float()
        v = torch.stack(sources).float()  # [m, T, d]
        w = self.folded_query()  # gamma folded into the query
        scores = (v * w).sum(-1) * torch.rsqrt(v.pow(2).mean(-1) + self.eps)  # [m, T]
        alpha = torch.softmax(scores, dim=0)
        return (alpha.unsqueeze(-1) * v).sum(0)

    def mix_and_norm(self, sources: list[torch.Tensor], out_norm: RMSNorm | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
        """The mix followed by the next sublayer's RMSNorm (None: the final mixer, no norm). On CUDA
        with K3SERVE_ATTNRES_BACKEND=triton (opt-in until timed) one fused pass per token."""
        if (sources[0].is_cuda and os.environ.get("K3SERVE_ATTNRES_BACKEND") == "triton" and len(sources) <= 16
                and (out_norm is None or out_norm.eps == self.eps)):
            from ..ops.attn_res_triton import attn_res_mix

            return attn_res_mix(torch.stack(sources), self.folded_query(), self.eps,
                                None if out_norm is None else out_norm.weight, out_dtype)
        mixed = self(sources)
        return mixed.to(out_dtype) if out_norm is None else out_norm(mixed, out_dtype=out_dtype)


class AttnResState:
    """The reference bookkeeping for one forward pass: stored blocks and the running partial,
    the partial rounded to the activation dtype after every addition (bit-close to the reference)."""

    def __init__(self, embeddings: torch.Tensor, block_size: int):
        self.block_size = block_size
        self.blocks: list[torch.Tensor] = []
        self.partial = embeddings

    def token_mixer_sources(self, layer: int, prev_ffn_out: torch.Tensor | None) -> list[torch.Tensor]:
        if layer > 0:
            self.partial = self.partial + prev_ffn_out
        if layer % self.block_size == 0:
            self.blocks.append(self.partial)
            return self.blocks[:-1] + [self.partial]
        return self.blocks + [self.partial]

    def channel_mixer_sources(self, layer: int, attn_out: torch.Tensor) -> list[torch.Tensor]:
        self.partial = attn_out if layer % self.block_size == 0 else self.partial + attn_out
        return self.blocks + [self.partial]

    def final_sources(self, last_ffn_out: torch.Tensor) -> list[torch.Tensor]:
        self.partial = self.partial + last_ffn_out
        return self.blocks + [self.partial]

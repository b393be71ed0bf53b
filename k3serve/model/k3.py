"""The K3-family network, assembled from the config: Kimi K3 and Kimi-Linear-48B-A3B alike.

Module names mirror the checkpoint tensor names (minus the ``model.`` / ``language_model.``
prefix), so the loader's name map is short and obvious.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from .attn_res import AttnResMixer, AttnResState
from .batch import CacheHandles, ForwardBatch
from .kda import KDAMixer
from .layers import LinearGroup, RMSNorm, add_rms_norm
from .mla import MLAMixer
from .moe import GLUMLP, MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype, device=None):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_kda = cfg.is_kda[layer]
        self.self_attn = KDAMixer(cfg, dtype, device) if self.is_kda else MLAMixer(cfg, dtype, device)
        if cfg.is_moe_layer(layer):
            self.block_sparse_moe = MoE(cfg, dtype, device)
        else:
            self.mlp = GLUMLP(cfg, d, cfg.intermediate_size, dtype, device)
        self.input_layernorm = RMSNorm(d, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype, device)
        if cfg.attn_res_block_size:
            self.self_attention_res = AttnResMixer(d, eps, dtype, device)
            self.mlp_res = AttnResMixer(d, eps, dtype, device)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)


class K3Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        d = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, dtype=dtype, device=device)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        if cfg.attn_res_block_size:
            self.output_attn_res = AttnResMixer(d, cfg.rms_norm_eps, dtype, device)


class K3ForCausalLM(nn.Module):
    """forward(batch, caches) -> pre-final-norm hidden states [T, d];
    compute_logits(hidden) -> fp32 logits (final norm applied there, so drafters get pre-norm h)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.config = cfg
        self.dtype = dtype
        self.model = K3Backbone(cfg, dtype, device)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if self.lm_head is not None:
            self.lm_head.weight.requires_grad_(False)
        self.attn_res_block_queries: list[torch.Tensor] | None = None  # (fuse_projections)
        # Layer -> ordinal within its cache kind.
        kda_i = mla_i = 0
        self.cache_index: list[int] = []
        for is_kda in cfg.is_kda:
            self.cache_index.append(kda_i if is_kda else mla_i)
            kda_i, mla_i = kda_i + is_kda, mla_i + (not is_kda)

    def fuse_projections(self) -> None:
        """For serving, after the weights are loaded: linears that read the same input become one
        GEMM and the KDA conv weights one tensor (the parameters become views: nothing is held
        twice); MLA keeps what its absorbed decode reads (``MLAMixer.cache_absorption_weight``);
        each AttnRes mixer folds its key-norm weight into its pseudo-query. A shared MLP that can
        join its layer's routed expert stacks does so first (moe.RoutedExperts.join_shared), and
        its linears then stay views of those stacks. Idempotent; training skips it (and fused
        groups run unfused with gradients on)."""
        for m in self.modules():
            if isinstance(m, MoE):
                m.join_shared_experts()
                m.experts.use_mma_layout_where_faster()
                if m.experts.num_shared and m.experts.stack("w1")[0].is_cuda:
                    # each layer's stacks grow by one expert, so the blocks the old ones free never fit
                    # the next layer's: hand them back now (kimi-linear-48b left ~46 GiB cached otherwise)
                    torch.cuda.empty_cache()
        for m in self.modules():
            if isinstance(m, LinearGroup):
                m.fuse()
            elif isinstance(m, KDAMixer):
                m.fuse_conv_weights()
            elif isinstance(m, MLAMixer):
                m.cache_absorption_weight()
            elif isinstance(m, AttnResMixer):
                m.fold_query()
        self.attn_res_block_queries = self._attn_res_block_queries()

    def _attn_res_block_queries(self) -> list[torch.Tensor] | None:
        """Each AttnRes block's mixers' folded queries in the order they run ([Q, d] fp32: the
        token and channel mixers of its layers, then the final mixer in the last block), for the
        block summaries (``AttnResState.mix``)."""
        B, layers = self.config.attn_res_block_size, self.model.layers
        if not B:
            return None
        blocks = []
        for start in range(0, len(layers), B):
            queries = [q for layer in layers[start: start + B]
                       for q in (layer.self_attention_res.folded_query(), layer.mlp_res.folded_query())]
            if start + B >= len(layers):
                queries.append(self.model.output_attn_res.folded_query())
            blocks.append(torch.stack(queries).contiguous())
        return blocks

    def forward(self, batch: ForwardBatch, caches: CacheHandles) -> torch.Tensor:
        """Serving callers run under inference_mode (the runner does); parameters are loaded with
        requires_grad=False, so no graph is built unless a trainer turns gradients on."""
        h = self.model.embed_tokens(batch.input_ids)
        B = self.config.attn_res_block_size
        res = AttnResState(h, B, len(self.model.layers), block_queries=self.attn_res_block_queries) if B else None
        m = x = None
        layers = self.model.layers
        for i, layer in enumerate(layers):
            cache = caches.kda[self.cache_index[i]] if layer.is_kda else caches.mla[self.cache_index[i]]
            if res is None:  # pre-norm residual stream; each add is fused with the norm that follows it
                if x is None:
                    x = layer.input_layernorm(h)
                delta = layer.self_attn(x, batch, cache)
                moe = getattr(layer, "block_sparse_moe", None)
                routed = None if moe is None else moe.add_norm_route(h, delta, layer.post_attention_layernorm)
                if routed is None:
                    h, x = add_rms_norm(h, delta, layer.post_attention_layernorm)
                    f = layer.ffn(x)
                else:  # the add + norm with the router's logits: one launch
                    h, x, logit_parts = routed
                    f = moe(x, logit_parts=logit_parts)
                if i + 1 < len(layers):
                    h, x = add_rms_norm(h, f, layers[i + 1].input_layernorm)
                else:
                    h = h + f  # the final norm runs on the sampled rows only (compute_logits)
                continue
            x = res.mix(layer.self_attention_res, res.token_mixer_sources(i, m), layer.input_layernorm, self.dtype)
            a = layer.self_attn(x, batch, cache)
            x = res.mix(layer.mlp_res, res.channel_mixer_sources(i, a), layer.post_attention_layernorm, self.dtype)
            m = layer.ffn(x)
        if res is not None:
            return res.mix(self.model.output_attn_res, res.final_sources(m), None, self.dtype)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        x = self.model.norm(hidden, out_dtype=self.dtype)
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(x, w).float()

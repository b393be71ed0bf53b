"""Gated NoPE MLA token mixer (model-spec §2.4).

Decode steps use the weight-absorbed form over the 576-wide latent (the cache is read once, no
per-head K/V); prefill chunks use the expanded form. No rotary embedding anywhere.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..ops import mla_ref
from ..ops.backend import triton_enabled
from .batch import ForwardBatch, MLALayerCache
from .layers import Linear, LinearGroup, RMSNorm, batched_linear, glu_activation, norm_kernel_on

# The prefill of a step's prompts in one launch (``mla_prefill_varlen``) instead of a gather, a key
# expansion, copies and a launch each (~7 launches a prompt a layer): kimi-linear-48b's eager
# prefill step of 16 x 512 tokens 229 -> 181 ms, with SORT_KERNEL 177 (RESULTS.md, sixteenth session).
VARLEN_PREFILL = True


class MLAMixer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device=None):
        super().__init__()
        d, Ha = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = Ha
        self.nope, self.rope, self.dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rkv = cfg.kv_lora_rank
        self.scale = cfg.qk_head_dim ** -0.5
        qk = cfg.qk_head_dim
        self.q_lora = cfg.q_lora_rank is not None
        if self.q_lora:
            self.q_a_proj = Linear(d, cfg.q_lora_rank, dtype, device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.mla_latent_norm_eps, dtype, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, Ha * qk, dtype, device, tp_dim=0)
        else:
            self.q_proj = Linear(d, Ha * qk, dtype, device, tp_dim=0)
        self.kv_a_proj_with_mqa = Linear(d, self.rkv + self.rope, dtype, device)
        self.kv_a_layernorm = RMSNorm(self.rkv, cfg.mla_latent_norm_eps, dtype, device)
        self.kv_b_proj = Linear(self.rkv, Ha * (self.nope + self.dv), dtype, device, tp_dim=0)
        self.output_gate = cfg.mla_use_output_gate
        if self.output_gate:
            self.g_proj = Linear(d, Ha * self.dv, dtype, device, tp_dim=0)
        self.o_proj = Linear(Ha * self.dv, d, dtype, device, tp_dim=1)
        # What reads the layer input x, one GEMM once fused: [q_a or q, kv_a (+ k_pe), output gate].
        self.in_proj = LinearGroup(self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa,
                                   *([self.g_proj] if self.output_gate else []))
        self.register_buffer("w_kv_b_f32", None, persistent=False)
        self.register_buffer("w_uk_t", None, persistent=False)

    def cache_absorption_weight(self) -> None:
        """What the absorbed decode reads, kept. The Triton path: W_UK transposed, [Ha, rkv, dn]
        in the model dtype (a quarter of an fp32 kv_b_proj: 0.3 instead of 1.2 GB over K3's 24 MLA
        layers), so the query absorption streams whole rows as a batched GEMV; W_UV is read in
        place. The reference path: kv_b_proj in fp32 (it absorbs and takes W_UV out in fp32),
        which otherwise converts the matrix per layer per step."""
        w = self.kv_b_proj.weight
        if triton_enabled("MLA", w.device):
            if self.w_uk_t is None:
                self.w_uk_t = self._kv_b_per_head()[0].transpose(1, 2).contiguous()
        elif self.w_kv_b_f32 is None:
            self.w_kv_b_f32 = w.float()

    def _kv_b_per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [Ha, dn, rkv], W_UV [Ha, dv, rkv]): views of kv_b_proj."""
        return self.kv_b_proj.weight.view(self.num_heads, -1, self.rkv).split([self.nope, self.dv], dim=1)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Queries [T, Ha, dn+dr], the latent projection [T, rkv+dr] = [c ; k_pe] (c not yet
        normalised) and the output-gate pre-activation (None without the gate)."""
        q, kv, *gate = self.in_proj(x)
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(q))
        return q.reshape(x.shape[0], self.num_heads, -1), kv, (gate[0] if gate else None)

    def write_latent(self, kv: torch.Tensor, batch: ForwardBatch, cache: MLALayerCache) -> None:
        """The new tokens' cache rows [normalised c ; k_pe] at their (page, offset); indexed by
        both, not through a flat view: the pool hands out strided per-layer views."""
        page, offset = batch.latent_page_offset
        if norm_kernel_on(kv) and kv.stride(-1) == 1 and cache.latent.stride(-1) == 1:
            from ..ops.norm_triton import latent_to_cache  # one launch, not norm + cat + indexed store

            latent_to_cache(kv, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, cache.latent, page, offset)
            return
        c, k_pe = kv.split([self.rkv, self.rope], dim=-1)
        cache.latent[page, offset] = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1).to(cache.latent.dtype)

    def attend(self, q: torch.Tensor, batch: ForwardBatch, latent_pages: torch.Tensor,
               out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Attention of every new token over its sequence's cached latents (new rows already written),
        computed in fp32 and rounded once to ``out_dtype`` as each part is written."""
        T = q.shape[0]
        out = torch.empty(T, self.num_heads, self.dv, dtype=out_dtype, device=q.device)
        nd = batch.num_decodes
        w = self.kv_b_proj.weight
        w_dec = self.w_kv_b_f32 if self.w_kv_b_f32 is not None else w  # absorbed decode runs in fp32
        if nd and triton_enabled("MLA", q.device):  # split-KV Triton decode
            from ..ops.mla_decode_triton import mla_decode

            # The absorbed query in the model dtype straight from one batched GEMV over the heads
            # (fp32 accumulation, one rounding: what the kernel reads anyway); q_pe stays a view of
            # q. W_UV is taken out the same way, the latent output rounded to the model dtype for
            # the tensor cores (as engines on FlashMLA's bf16 output do), accumulated in fp32
            # straight into ``out``.
            w_uk, w_uv = self._kv_b_per_head()
            w_uk_t = self.w_uk_t if self.w_uk_t is not None else w_uk.transpose(1, 2)
            q_c = torch.empty(nd, self.num_heads, self.rkv, dtype=q.dtype, device=q.device)
            batched_linear(q[:nd, :, :self.nope].transpose(0, 1), w_uk_t, out=q_c.transpose(0, 1), static_weight=True)
            o_lat = mla_decode(q_c, latent_pages, batch.block_table[:nd], batch.seq_lens[:nd], self.rkv, self.scale,
                               q_pe=q[:nd, :, self.nope:])
            batched_linear(o_lat.transpose(0, 1), w_uv, out=out[:nd].transpose(0, 1), static_weight=True)
        elif nd:
            # Static steps attend over the block table's full width (masked), not a host maximum.
            max_len = (batch.block_table.shape[1] * batch.page_size if batch.static_shapes
                       else max(batch.context_lens_host[:nd]) + 1)
            table = batch.block_table[:nd, : -(-max_len // batch.page_size)].clamp_min(0)
            lat = latent_pages[table].flatten(1, 2)[:, :max_len]  # [nd, S, 576]
            mask = torch.arange(max_len, device=q.device)[None, :] < batch.seq_lens[:nd, None]
            q_abs = mla_ref.absorb_query(q[:nd], w_dec, self.rkv, self.nope)
            o_lat = mla_ref.mla_absorbed_ref(q_abs[:, None], lat, mask[:, None], self.rkv, self.scale)
            out[:nd] = mla_ref.unabsorb_output(o_lat[:, 0], w_dec, self.rkv, self.nope)
        if VARLEN_PREFILL and nd < batch.num_seqs and triton_enabled("MLA", q.device):
            from ..ops.mla_prefill_triton import mla_prefill_varlen  # every prompt in one launch

            page, offset, seqs, max_new = batch.prefill_latents
            mla_prefill_varlen(q[nd:], latent_pages[page, offset], w, seqs, max_new, self.rkv, self.nope, self.scale,
                               out=out[nd:])  # (decode tokens lead, one each)
            return out
        for i in range(nd, batch.num_seqs):
            s, e = batch.token_range(i)
            ctx = batch.context_lens_host[i]
            lat = mla_ref.gather_latent(latent_pages, batch.block_table[i], ctx + e - s)
            if triton_enabled("MLA", q.device):
                from ..ops.mla_prefill_triton import mla_prefill  # flash-style, no T x S scores

                mla_prefill(q[s:e], lat, w, ctx, self.rkv, self.nope, self.scale, out=out[s:e])
            else:
                out[s:e] = mla_ref.mla_expanded_ref(q[s:e], lat, w, ctx, self.rkv, self.nope, self.scale)
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: MLALayerCache) -> torch.Tensor:
        q, kv, gate = self.project(x)
        self.write_latent(kv, batch, cache)
        # fp32 for the output gate; without it straight in the model dtype (the same single rounding
        # as a cast after, without the cast's launch at decode)
        o = self.attend(q, batch, cache.latent, torch.float32 if gate is not None else x.dtype).reshape(x.shape[0], -1)
        if gate is not None:  # sigmoid(gate) * o in fp32, rounded once to the gate's (model) dtype
            o = glu_activation(gate, o, "sigmoid")
        return self.o_proj(o.to(x.dtype))

"""Named model shapes as raw config.json dicts (they go through the same parser as real files).

- ``tiny``: a few million parameters, every K3 feature (KDA + MLA, dense first layer, latent MoE
  with norm and shared experts, grouped routing, SiTU, AttnRes with 3 blocks, full-rank and
  lower-bounded KDA gates, MLA q-LoRA and output gate); CPU tests.
- ``kimi-linear-48b``: Kimi-Linear-48B-A3B as published.
- ``k3-slice``: true K3 widths, first four layers (dense KDA, two MoE KDA, one MoE MLA).
- ``k3``: the full Kimi K3 text model (planning; 2.8T parameters).
"""

from __future__ import annotations

import copy

MXFP4_QUANT = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group",
                        "symmetric": True, "scale_dtype": "torch.uint8"},
            "input_activations": None,
            "output_activations": None,
        }
    },
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp.*", "lm_head", "re:vision_tower.*",
               "re:mm_projector.*"],
}

# Special-token ids of the K3 family sit in the top 256 ids of the vocabulary.
K3_SPECIAL_BASE = 163584


def _k3_text(num_layers: int, full_attn_1based: list[int]) -> dict:
    return {
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": num_layers,
        "intermediate_size": 33792,
        "num_attention_heads": 96,
        "num_key_value_heads": 96,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 896,
        "num_experts_per_token": 16,
        "moe_intermediate_size": 3072,
        "num_shared_experts": 2,
        "routed_scaling_factor": 1.0,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_expert_hidden_size": 3584,
        "latent_moe_use_norm": True,
        "attn_res_block_size": 12,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, num_layers + 1) if i not in full_attn_1based],
            "full_attn_layers": full_attn_1based,
            "num_heads": 96,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "quantization_config": copy.deepcopy(MXFP4_QUANT),
        "dtype": "bfloat16",
    }


def _k3_wrapper(text: dict) -> dict:
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "media_placeholder_token_id": 163605,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
    }


def _tiny() -> dict:
    vocab = 2048
    base = vocab - 256  # specials at the same offsets as the real K3 table
    text = {
        "model_type": "kimi_linear",
        "vocab_size": vocab,
        "hidden_size": 128,
        "num_hidden_layers": 6,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "rms_norm_eps": 1e-5,
        "model_max_length": 65536,
        "tie_word_embeddings": False,
        "bos_token_id": base,
        "eos_token_id": base + 2,
        "pad_token_id": vocab - 1,
        "q_lora_rank": 64,
        "kv_lora_rank": 64,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": 16,
        "num_experts_per_token": 4,
        "moe_intermediate_size": 64,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.0,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 4,
        "topk_group": 2,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_expert_hidden_size": 64,
        "latent_moe_use_norm": True,
        "attn_res_block_size": 2,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [1, 2, 4, 5],
            "full_attn_layers": [3, 6],
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
        },
        "dtype": "bfloat16",
    }
    return _k3_wrapper(text)


def _kimi_linear_48b() -> dict:
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": 163840,
        "hidden_size": 2304,
        "num_hidden_layers": 27,
        "intermediate_size": 9216,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 72,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "bos_token_id": 163584,
        "eos_token_id": 163586,
        "pad_token_id": 163839,
        "q_lora_rank": None,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "mla_use_nope": True,
        "num_experts": 256,
        "num_experts_per_token": 8,
        "moe_intermediate_size": 1024,
        "num_shared_experts": 1,
        "routed_scaling_factor": 2.446,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "linear_attn_config": {
            "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
        "dtype": "bfloat16",
    }


def _k3() -> dict:
    full = [i for i in range(4, 93, 4)] + [93]
    return _k3_wrapper(_k3_text(93, full))


def _k3_slice() -> dict:
    return _k3_wrapper(_k3_text(4, [4]))


PRESETS = {
    "tiny": _tiny,
    "kimi-linear-48b": _kimi_linear_48b,
    "k3-slice": _k3_slice,
    "k3": _k3,
}


def preset_config(name: str, mxfp4: bool | None = None) -> dict:
    """Raw config.json dict of a preset. ``mxfp4`` forces MXFP4 routed experts on (True) or off (False)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}: choose from {', '.join(PRESETS)}")
    raw = PRESETS[name]()
    text = raw.get("text_config", raw)
    if mxfp4 is True:
        text["quantization_config"] = copy.deepcopy(MXFP4_QUANT)
    elif mxfp4 is False:
        text.pop("quantization_config", None)
    return raw

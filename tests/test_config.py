"""ModelConfig: both layouts, the K3 wrapper, and refusals with clear messages."""

import copy

import pytest

from k3serve.config import ConfigError, ModelConfig
from k3serve.presets import preset_config


def test_k3_preset_layer_plan():
    cfg = ModelConfig.from_dict(preset_config("k3"))
    assert cfg.model_type == "kimi_k3" and cfg.checkpoint_prefix == "language_model.model."
    assert cfg.num_hidden_layers == 93 and cfg.num_kda_layers == 69 and cfg.num_mla_layers == 24
    mla = [i for i, k in enumerate(cfg.is_kda) if not k]
    assert mla == list(range(3, 92, 4)) + [92]  # 0-based 3, 7, ..., 91 and 92
    assert cfg.num_attn_res_blocks == 8 and cfg.expert_format == "mxfp4"
    assert cfg.kda_gate_lower_bound == -5.0 and cfg.kda_full_rank_gate
    assert cfg.mla_cache_width == 576 and cfg.mla_latent_norm_eps == 1e-5
    assert not cfg.is_moe_layer(0) and all(cfg.is_moe_layer(i) for i in range(1, 93))


def test_kimi_linear_preset():
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-48b"))
    assert cfg.model_type == "kimi_linear" and cfg.checkpoint_prefix == "model."
    assert [i for i, k in enumerate(cfg.is_kda) if not k] == [3, 7, 11, 15, 19, 23, 26]
    assert cfg.q_lora_rank is None and cfg.expert_format == "bf16" and cfg.mla_latent_norm_eps == 1e-6
    assert cfg.kda_gate_lower_bound is None and not cfg.kda_full_rank_gate


def test_hf_aliases():
    raw = preset_config("kimi-linear-48b")
    for new, old in (("num_experts_per_tok", "num_experts_per_token"), ("n_shared_experts", "num_shared_experts"),
                     ("norm_topk_prob", "moe_renormalize"), ("n_group", "num_expert_group")):
        raw[new] = raw.pop(old)
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_experts_per_token == 8 and cfg.num_shared_experts == 1 and cfg.moe_renormalize


def _bad(mutate, match, preset="kimi-linear-48b"):
    raw = copy.deepcopy(preset_config(preset))
    mutate(raw.get("text_config", raw))
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_rope_scaling_is_refused():
    _bad(lambda t: t.update(rope_scaling={"type": "yarn", "factor": 4.0}), "NoPE")
    _bad(lambda t: t.update(rope_scaling={"rope_type": "linear", "factor": 2.0}), "NoPE", preset="k3")
    _bad(lambda t: t.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "NoPE")
    _bad(lambda t: t.update(mla_use_nope=False), "NoPE")


def test_inconsistent_layer_lists():
    _bad(lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 3, 4]), "both KDA and full attention")
    _bad(lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 8]), "neither")
    _bad(lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 8, 12, 16, 20, 24, 28]), "1-based")
    _bad(lambda t: t["linear_attn_config"].update(kda_layers=[0, 1, 2]), "1-based")
    _bad(lambda t: t["linear_attn_config"].pop("full_attn_layers"), "both")
    _bad(lambda t: t.pop("linear_attn_config"), "cannot tell")


def test_unknown_activation_router_model_type():
    _bad(lambda t: t.update(hidden_act="gelu"), "unknown hidden_act 'gelu'")
    _bad(lambda t: t.update(moe_router_activation_func="sparsemax"), "moe_router_activation_func")
    _bad(lambda t: t.update(topk_method="greedy"), "topk_method")
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        ModelConfig.from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "kimi_k3"})


def test_gate_bound_and_moe_validation():
    _bad(lambda t: t["linear_attn_config"].update(gate_lower_bound=-6.0), "-5 <= lower_bound < 0", preset="k3")
    _bad(lambda t: t["linear_attn_config"].update(gate_lower_bound=0.0), "-5 <= lower_bound < 0", preset="k3")
    _bad(lambda t: t.update(num_expert_group=3), "not divisible")
    _bad(lambda t: t.update(num_experts_per_token=300), "num_experts_per_token")
    _bad(lambda t: t.update(quantization_config={"quant_method": "gptq"}), "unsupported quantization_config")


def test_transformers5_mlp_layer_types():
    raw = preset_config("kimi-linear-48b")
    raw.pop("first_k_dense_replace")
    raw["mlp_layer_types"] = ["dense"] * 2 + ["sparse"] * 25
    assert ModelConfig.from_dict(raw).first_k_dense_replace == 2
    raw["mlp_layer_types"] = ["dense", "sparse", "dense"] + ["sparse"] * 24
    with pytest.raises(ConfigError, match="mlp_layer_types"):
        ModelConfig.from_dict(raw)

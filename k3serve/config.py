"""ModelConfig: one normalised view of every config layout the K3 family ships.

Accepted layouts (model-spec.md §1):
- ``kimi_linear`` as Moonshot published it (``linear_attn_config`` with 1-based layer lists),
- ``kimi_linear`` as HF transformers >= 5 writes it (``layer_types`` / ``mlp_layer_types``),
- ``kimi_k3``: the multimodal wrapper with the text model under ``text_config``.
Everything downstream reads only this dataclass, never the raw dict.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that k3serve refuses, with the reason in words."""


SUPPORTED_ACTIVATIONS = ("silu", "situ")
SUPPORTED_ROUTER_FUNCS = ("sigmoid", "softmax")
SUPPORTED_MODEL_TYPES = ("kimi_linear", "kimi_k3")


@dataclass(frozen=True)
class ModelConfig:
    # Trunk
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    # FFN activation (dense MLP, shared and routed experts)
    hidden_act: str = "silu"
    situ_beta: float = 1.0
    situ_linear_beta: float | None = None
    intermediate_size: int = 0
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    # KDA
    kda_layers: tuple[int, ...] = ()  # 0-based
    kda_num_heads: int = 0
    kda_head_dim: int = 128
    kda_conv_size: int = 4
    kda_full_rank_gate: bool = False
    kda_gate_lower_bound: float | None = None
    # MLA
    num_attention_heads: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_use_output_gate: bool = False
    mla_latent_norm_eps: float = 1e-6  # q_a / kv_a norms: 1e-6 for Kimi-Linear (HF), 1e-5 for K3
    # MoE
    num_experts: int | None = None
    num_experts_per_token: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    use_grouped_topk: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None
    latent_moe_use_norm: bool = False
    expert_format: str = "bf16"  # "bf16" or "mxfp4" (routed experts only), as served
    experts_quantized_at_load: bool = False  # bf16 in the checkpoint, MXFP4 in memory (with_quantization)
    # Block Attention Residuals
    attn_res_block_size: int | None = None
    # Where the text model sits in the checkpoint ("model." or "language_model.model.")
    checkpoint_prefix: str = "model."
    num_nextn_predict_layers: int = 0
    model_type: str = "kimi_linear"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived quantities -------------------------------------------------------------
    @property
    def is_kda(self) -> tuple[bool, ...]:
        kda = set(self.kda_layers)
        return tuple(i in kda for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.num_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % self.moe_layer_freq == 0
        )

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return self.num_hidden_layers - len(self.kda_layers)

    @property
    def kda_proj_size(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def mla_cache_width(self) -> int:
        """Values per token per MLA layer in the latent cache: [c (rkv) ; k_pe (dr)]."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def num_attn_res_blocks(self) -> int:
        return math.ceil(self.num_hidden_layers / self.attn_res_block_size) if self.attn_res_block_size else 0

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    def with_quantization(self, method: str | None) -> "ModelConfig":
        """The config served under ``--quantization``. None keeps the checkpoint's formats;
        ``mxfp4`` serves the routed experts as W4A16 MXFP4 (K3's own format and kernels) and
        quantises bf16 ones as they load: a quarter of the expert bytes each decode step reads,
        for MXFP4's rounding error. A checkpoint already in MXFP4 is served as it is."""
        if method is None or (method == "mxfp4" and self.expert_format == "mxfp4"):
            return self
        if method != "mxfp4":
            raise ConfigError(f"unknown quantization {method!r}: k3serve quantises routed experts to 'mxfp4'")
        if self.num_experts is None:
            raise ConfigError("quantization 'mxfp4' applies to routed experts, and this model has none")
        _check_mxfp4_widths(self.routed_expert_hidden_size or self.hidden_size, self.moe_intermediate_size)
        return replace(self, expert_format="mxfp4", experts_quantized_at_load=True)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("raw")
        return d

    # ---- loading ------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise ConfigError(f"{path}: no config.json in the model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unknown model_type {model_type!r}: k3serve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == "kimi_k3":
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("model_type 'kimi_k3' needs a 'text_config' object holding the text model")
            text = dict(text)
            text.setdefault("model_type", "kimi_linear")
            for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
                if text.get(key) is None and raw.get(key) is not None:
                    text[key] = raw[key]
            return _parse_text_config(text, wrapper=raw)
        return _parse_text_config(raw, wrapper=None)


def _get(d: dict, *names: str, default: Any = None) -> Any:
    """First present, non-null key among HF aliases."""
    for n in names:
        if d.get(n) is not None:
            return d[n]
    return default


def _layer_lists(t: dict, num_layers: int) -> tuple[tuple[int, ...], dict]:
    """Returns the 0-based KDA layer indices and the KDA geometry from either layout."""
    lac = t.get("linear_attn_config")
    if lac is not None:
        if not isinstance(lac, dict):
            raise ConfigError("linear_attn_config must be an object")
        kda1, full1 = lac.get("kda_layers"), lac.get("full_attn_layers")
        if kda1 is None or full1 is None:
            raise ConfigError("linear_attn_config needs both 'kda_layers' and 'full_attn_layers' (1-based lists)")
        for name, lst in (("kda_layers", kda1), ("full_attn_layers", full1)):
            bad = [i for i in lst if not isinstance(i, int) or not 1 <= i <= num_layers]
            if bad:
                raise ConfigError(
                    f"linear_attn_config.{name} holds {bad}: entries are 1-based layer numbers in 1..{num_layers}"
                )
            if len(set(lst)) != len(lst):
                raise ConfigError(f"linear_attn_config.{name} repeats a layer")
        both = sorted(set(kda1) & set(full1))
        if both:
            raise ConfigError(f"layers {both} (1-based) are listed as both KDA and full attention")
        missing = sorted(set(range(1, num_layers + 1)) - set(kda1) - set(full1))
        if missing:
            raise ConfigError(
                f"layers {missing} (1-based) are in neither kda_layers nor full_attn_layers "
                f"of a {num_layers}-layer model"
            )
        geo = dict(
            kda_num_heads=lac.get("num_heads"),
            kda_head_dim=lac.get("head_dim"),
            kda_conv_size=lac.get("short_conv_kernel_size", 4),
            kda_full_rank_gate=bool(lac.get("use_full_rank_gate", False)),
            kda_gate_lower_bound=lac.get("gate_lower_bound"),
        )
        return tuple(sorted(i - 1 for i in kda1)), geo
    types = t.get("layer_types")
    if types is None:
        raise ConfigError("config has neither 'linear_attn_config' nor 'layer_types': cannot tell KDA from MLA layers")
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted({x for x in types} - {"linear_attention", "full_attention"})
    if unknown:
        raise ConfigError(f"layer_types holds unknown kinds {unknown}: expected linear_attention / full_attention")
    geo = dict(
        kda_num_heads=t.get("linear_num_heads"),
        kda_head_dim=t.get("linear_head_dim", 128),
        kda_conv_size=t.get("linear_conv_kernel_dim", 4),
        kda_full_rank_gate=bool(t.get("use_full_rank_gate", False)),
        kda_gate_lower_bound=t.get("gate_lower_bound"),
    )
    return tuple(i for i, x in enumerate(types) if x == "linear_attention"), geo


def _dense_layout(t: dict, num_layers: int) -> tuple[int, int]:
    """first_k_dense_replace and moe_layer_freq, from either layout."""
    mlp_types = t.get("mlp_layer_types")
    if mlp_types is None or "first_k_dense_replace" in t:
        return int(_get(t, "first_k_dense_replace", default=1)), int(_get(t, "moe_layer_freq", default=1))
    if len(mlp_types) != num_layers:
        raise ConfigError(f"mlp_layer_types has {len(mlp_types)} entries for num_hidden_layers={num_layers}")
    unknown = sorted(set(mlp_types) - {"dense", "sparse"})
    if unknown:
        raise ConfigError(f"mlp_layer_types holds unknown kinds {unknown}: expected dense / sparse")
    first_sparse = mlp_types.index("sparse") if "sparse" in mlp_types else num_layers
    # Express the list as (first_k_dense, freq); refuse patterns that have no such form.
    for freq in range(1, num_layers + 1):
        expect = ["sparse" if i >= first_sparse and i % freq == 0 else "dense" for i in range(num_layers)]
        if expect == list(mlp_types):
            return first_sparse, freq
    raise ConfigError("mlp_layer_types is not 'dense for the first k layers, then sparse every n-th layer'")


def _parse_text_config(t: dict, wrapper: dict | None) -> ModelConfig:
    num_layers = t.get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ConfigError("num_hidden_layers must be a positive integer")
    for key in ("vocab_size", "hidden_size"):
        if not isinstance(t.get(key), int) or t[key] <= 0:
            raise ConfigError(f"{key} must be a positive integer")

    # NoPE: refuse every rotary setting instead of silently dropping it.
    rope_scaling = t.get("rope_scaling")
    if rope_scaling:
        kind = rope_scaling.get("type", rope_scaling.get("rope_type")) if isinstance(rope_scaling, dict) else rope_scaling
        raise ConfigError(
            f"rope_scaling={kind!r} is set, but the MLA layers of this model family are NoPE (no rotary "
            "embedding at all), so RoPE scaling / YaRN has nothing to scale; remove rope_scaling from config.json"
        )
    rope_params = t.get("rope_parameters")
    if isinstance(rope_params, dict) and rope_params.get("rope_type", "default") != "default":
        raise ConfigError(
            f"rope_parameters.rope_type={rope_params.get('rope_type')!r}: MLA layers are NoPE, "
            "RoPE scaling / YaRN does not apply to this model family"
        )
    if t.get("mla_use_nope") is False:
        raise ConfigError("mla_use_nope=false: this model family's MLA layers are NoPE; rotary MLA is not supported")

    act = t.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(f"unknown hidden_act {act!r}: supported are {', '.join(SUPPORTED_ACTIVATIONS)}")
    router = t.get("moe_router_activation_func", "sigmoid")
    if router not in SUPPORTED_ROUTER_FUNCS:
        raise ConfigError(
            f"unknown moe_router_activation_func {router!r}: supported are {', '.join(SUPPORTED_ROUTER_FUNCS)}"
        )
    topk_method = t.get("topk_method", "noaux_tc")
    if topk_method not in ("noaux_tc", None):
        raise ConfigError(f"unknown topk_method {topk_method!r}: only 'noaux_tc' (bias-corrected selection) is supported")

    kda_layers, geo = _layer_lists(t, num_layers)
    if kda_layers:
        for key in ("kda_num_heads", "kda_head_dim", "kda_conv_size"):
            if not isinstance(geo[key], int) or geo[key] <= 0:
                raise ConfigError(f"KDA geometry: {key} must be a positive integer (got {geo[key]!r})")
    lb = geo["kda_gate_lower_bound"]
    if lb is not None and not (-5.0 <= float(lb) < 0.0):
        raise ConfigError(f"gate_lower_bound={lb}: must satisfy -5 <= lower_bound < 0")
    first_dense, freq = _dense_layout(t, num_layers)

    num_experts = _get(t, "num_experts", "num_local_experts", "n_routed_experts")
    k = int(_get(t, "num_experts_per_token", "num_experts_per_tok", default=0))
    groups = int(_get(t, "num_expert_group", "n_group", default=1))
    topk_group = int(_get(t, "topk_group", default=1))
    if num_experts is not None:
        if not 1 <= k <= num_experts:
            raise ConfigError(f"num_experts_per_token={k} must be in 1..num_experts={num_experts}")
        if num_experts % groups:
            raise ConfigError(f"num_experts={num_experts} is not divisible by num_expert_group={groups}")
        if not 1 <= topk_group <= groups:
            raise ConfigError(f"topk_group={topk_group} must be in 1..num_expert_group={groups}")
        if k > topk_group * (num_experts // groups):
            raise ConfigError(f"num_experts_per_token={k} exceeds the experts in the {topk_group} kept groups")
        if groups > 1 and num_experts // groups < 2:
            raise ConfigError("grouped top-k scores each group by its 2 best experts: groups need >= 2 experts")

    num_heads = t.get("num_attention_heads")
    if len(kda_layers) < num_layers and (not isinstance(num_heads, int) or num_heads <= 0):
        raise ConfigError("num_attention_heads must be a positive integer when the model has MLA layers")
    dl = t.get("routed_expert_hidden_size")

    quant = t.get("quantization_config") or (wrapper or {}).get("quantization_config")
    expert_format = _expert_format(quant)
    if expert_format == "mxfp4":
        _check_mxfp4_widths(dl if dl is not None else t["hidden_size"], t.get("moe_intermediate_size", 0))

    situ_beta = t.get("activation_situ_beta")
    return ModelConfig(
        vocab_size=t["vocab_size"],
        hidden_size=t["hidden_size"],
        num_hidden_layers=num_layers,
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
        max_position_embeddings=int(_get(t, "model_max_length", "max_position_embeddings", default=1048576)),
        bos_token_id=t.get("bos_token_id"),
        eos_token_id=t.get("eos_token_id"),
        pad_token_id=t.get("pad_token_id"),
        torch_dtype=str(_get(t, "dtype", "torch_dtype", default="bfloat16")),
        hidden_act=act,
        situ_beta=float(situ_beta) if situ_beta is not None else 1.0,
        situ_linear_beta=t.get("activation_situ_linear_beta"),
        intermediate_size=int(t.get("intermediate_size", 0)),
        first_k_dense_replace=first_dense,
        moe_layer_freq=freq,
        kda_layers=kda_layers,
        kda_num_heads=int(geo["kda_num_heads"] or 0),
        kda_head_dim=int(geo["kda_head_dim"] or 128),
        kda_conv_size=int(geo["kda_conv_size"] or 4),
        kda_full_rank_gate=geo["kda_full_rank_gate"],
        kda_gate_lower_bound=float(lb) if lb is not None else None,
        num_attention_heads=int(num_heads or 0),
        q_lora_rank=t.get("q_lora_rank"),
        kv_lora_rank=int(t.get("kv_lora_rank", 512)),
        qk_nope_head_dim=int(t.get("qk_nope_head_dim", 128)),
        qk_rope_head_dim=int(t.get("qk_rope_head_dim", 64)),
        v_head_dim=int(t.get("v_head_dim", 128)),
        mla_use_output_gate=bool(t.get("mla_use_output_gate", False)),
        mla_latent_norm_eps=float(t.get("rms_norm_eps", 1e-5)) if wrapper is not None else 1e-6,
        num_experts=num_experts,
        num_experts_per_token=k,
        moe_intermediate_size=int(t.get("moe_intermediate_size", 0)),
        num_shared_experts=int(_get(t, "num_shared_experts", "n_shared_experts", default=0)),
        routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
        moe_renormalize=bool(_get(t, "moe_renormalize", "norm_topk_prob", default=True)),
        moe_router_activation_func=router,
        use_grouped_topk=bool(t.get("use_grouped_topk", True)),
        num_expert_group=groups,
        topk_group=topk_group,
        routed_expert_hidden_size=dl,
        latent_moe_use_norm=bool(t.get("latent_moe_use_norm", False)),
        expert_format=expert_format,
        attn_res_block_size=t.get("attn_res_block_size"),
        checkpoint_prefix="language_model.model." if wrapper is not None else "model.",
        num_nextn_predict_layers=int(t.get("num_nextn_predict_layers") or 0),
        model_type="kimi_k3" if wrapper is not None else "kimi_linear",
        raw=dict(wrapper if wrapper is not None else t),
    )


def _check_mxfp4_widths(din: int, inter: int) -> None:
    for name, width in (("expert input width", din), ("moe_intermediate_size", inter)):
        if width % 32:
            raise ConfigError(f"MXFP4 experts need {name}={width} divisible by the group size 32")


def _expert_format(quant: dict | None) -> str:
    if not quant:
        return "bf16"
    method = quant.get("quant_method")
    fmt = quant.get("format")
    if method == "compressed-tensors" and fmt == "mxfp4-pack-quantized":
        return "mxfp4"
    raise ConfigError(
        f"unsupported quantization_config (quant_method={method!r}, format={fmt!r}): "
        "k3serve reads compressed-tensors 'mxfp4-pack-quantized' routed experts or unquantized weights"
    )

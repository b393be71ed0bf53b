"""Checkpoint reading: safetensors (single file or sharded), Kimi-Linear and K3 names, MXFP4.

The model is created with uninitialised parameters on the target device and every checkpoint
tensor is copied straight into its parameter, one tensor at a time (memory-mapped reads), so
the weights are never held twice. The same name map drives the ``dummy`` load format and
``k3serve make-model``: random tensors in checkpoint shapes go through the very same copy path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..config import ModelConfig
from ..ops.mxfp4 import quantize_mxfp4

log = logging.getLogger(__name__)

CHECKSUM_FILE = "checksums.sha256"
_IGNORED = re.compile(r"^(vision_tower\.|mm_projector\.|.*rotary_emb\.inv_freq$)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and tensor."""


@dataclass
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally one expert's row of a stack."""

    param: torch.Tensor
    expert: int | None
    shape: tuple[int, ...]  # shape the checkpoint must have (after accepted layout variants)
    adapt: Callable[[torch.Tensor], torch.Tensor]  # checkpoint tensor -> parameter (slice)
    scale: torch.Tensor | None = None  # quantised at load: param takes the MXFP4 codes, this the scales


_EXPERT = re.compile(r"^(.*\.experts)\.(w[123])(_packed|_scale)?$")
_SUFFIX = {None: "weight", "_packed": "weight_packed", "_scale": "weight_scale"}


def _checkpoint_name(inner: str) -> str:
    """Model parameter name (below ``model.``) -> checkpoint tensor name (below the prefix)."""
    inner = re.sub(r"(self_attention_res|mlp_res|output_attn_res)\.(proj|norm)$", r"\1_\2.weight", inner)
    inner = re.sub(r"\.(q_conv1d|k_conv1d|v_conv1d|o_norm)$", r".\1.weight", inner)
    return inner


def _a_log_adapter(num_heads: int) -> tuple[Callable, Callable]:
    """A_log ships as [H], legacy [1,1,H,1], or (K3) a longer 1-D tensor whose first H are used."""
    def shape_ok(t: torch.Tensor) -> bool:
        return (t.dim() == 1 and t.shape[0] >= num_heads) or tuple(t.shape) == (1, 1, num_heads, 1)
    return shape_ok, lambda t: t.reshape(-1)[:num_heads]


def checkpoint_targets(model: torch.nn.Module) -> dict[str, Target]:
    """Every tensor name the checkpoint must contain, mapped to its destination."""
    cfg: ModelConfig = model.config
    prefix = cfg.checkpoint_prefix
    head = prefix[: -len("model.")]  # "" or "language_model."
    modules = dict(model.named_modules())
    targets: dict[str, Target] = {}
    for pname, p in model.named_parameters():
        if pname.startswith("lm_head."):
            targets[head + pname] = Target(p, None, tuple(p.shape), lambda t: t)
            continue
        inner = pname[len("model."):]
        owner = modules.get(pname.rsplit(".", 1)[0])
        m = _EXPERT.match(inner)
        if m:
            base, w, kind = m.groups()
            if cfg.experts_quantized_at_load:  # one bf16 tensor in the files fills both halves
                if kind == "_packed":
                    scale = getattr(owner, f"{w}_scale")
                    for e in range(p.shape[0]):
                        name = f"{prefix}{base}.{e}.{w}.weight"
                        targets[name] = Target(p, e, (p.shape[1], 2 * p.shape[2]), lambda t: t, scale)
                continue
            for e in range(p.shape[0]):
                name = f"{prefix}{base}.{e}.{w}.{_SUFFIX[kind]}"
                targets[name] = Target(p, e, tuple(p.shape[1:]), lambda t: t)
            continue
        name = prefix + _checkpoint_name(inner)
        shape = tuple(owner.full_shape) if hasattr(owner, "full_shape") else tuple(p.shape)
        adapt = owner.shard if hasattr(owner, "shard") else (lambda t: t)
        targets[name] = Target(p, None, shape, adapt)
    return targets


def _accept_layout(name: str, t: torch.Tensor, target: Target, cfg: ModelConfig) -> torch.Tensor:
    """Normalise the accepted layout variants, or raise naming the tensor."""
    if name.endswith(".A_log"):
        ok, fix = _a_log_adapter(cfg.kda_num_heads)
        if ok(t):
            return fix(t)
    elif name.endswith("_conv1d.weight") and t.dim() == 3 and t.shape[1] == 1:
        t = t[:, 0]
    if tuple(t.shape) != target.shape:
        raise CheckpointError(f"tensor {name}: shape {list(t.shape)} in the checkpoint, expected {list(target.shape)}")
    return t


def _copy_into(name: str, t: torch.Tensor, target: Target, cfg: ModelConfig) -> None:
    t = target.adapt(_accept_layout(name, t, target, cfg))
    if target.scale is not None:
        _quantize_into(name, t, target)
        return
    want_int = target.param.dtype == torch.uint8
    if want_int != (t.dtype == torch.uint8) or not (want_int or t.dtype.is_floating_point):
        raise CheckpointError(f"tensor {name}: dtype {t.dtype} in the checkpoint, expected "
                              f"{'uint8 (MXFP4)' if want_int else 'a floating-point dtype'}")
    if name.endswith(".weight_scale") and bool((t == 255).any()):
        raise CheckpointError(f"tensor {name}: E8M0 scale byte 255 (NaN) is not a valid MXFP4 scale")
    dst = target.param.data if target.expert is None else target.param.data[target.expert]
    dst.copy_(t)
    if dst.is_floating_point() and not bool(torch.isfinite(dst).all()):  # (read where it landed: a GPU's pace)
        bad = ~torch.isfinite(dst)
        raise CheckpointError(f"tensor {name}: {int(bad.sum())} non-finite values (NaN / inf, as loaded in "
                              f"{dst.dtype}), the first at index {[int(i) for i in bad.nonzero()[0]]}")


def _quantize_into(name: str, t: torch.Tensor, target: Target) -> None:
    """One bf16 expert matrix -> its MXFP4 codes and scales, on the parameter's device (the GPU
    quantises a 48B model's experts in seconds)."""
    if not t.is_floating_point():
        raise CheckpointError(f"tensor {name}: dtype {t.dtype} in the checkpoint, expected a floating-point "
                              "expert weight to quantise to MXFP4")
    try:
        packed, scale = quantize_mxfp4(t.to(target.param.device))
    except ValueError as exc:
        raise CheckpointError(f"tensor {name}: {exc}") from exc
    target.param.data[target.expert].copy_(packed)
    target.scale.data[target.expert].copy_(scale)


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
        files = sorted(set(weight_map.values()))
        for f in files:
            if not (model_dir / f).exists():
                example = next(k for k, v in weight_map.items() if v == f)
                raise CheckpointError(f"shard {f} listed in {index.name} (e.g. for tensor {example}) does not exist")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{model_dir}: no model.safetensors, no model.safetensors.index.json, no *.safetensors")
    return found


_HF5_DENSE = re.compile(r"(layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$")


def _canonical(name: str, cfg: ModelConfig) -> str:
    # The K3 reference also accepts language_model.layers.N.* for language_model.model.layers.N.*
    if cfg.checkpoint_prefix == "language_model.model." and name.startswith("language_model.layers."):
        name = "language_model.model." + name[len("language_model."):]
    # transformers >= 5 save_pretrained renames every ".mlp." to ".block_sparse_moe.", the dense
    # MLP of the first layer(s) included (not in model-spec.md; found with transformers 5.23).
    return _HF5_DENSE.sub(r"\1.mlp.\2.weight", name)


def _is_ignored(name: str, cfg: ModelConfig) -> bool:
    if _IGNORED.match(name):
        return True
    m = re.match(re.escape(cfg.checkpoint_prefix) + r"layers\.(\d+)\.", name)
    # MTP layers (index >= L) are not used by the main model.
    return bool(m) and int(m.group(1)) >= cfg.num_hidden_layers


def verify_checksums(model_dir: str | Path) -> None:
    """Compare every shard with the sha256 manifest (``sha256sum`` format) in the directory."""
    model_dir = Path(model_dir)
    manifest = model_dir / CHECKSUM_FILE
    if not manifest.exists():
        raise CheckpointError(f"{manifest}: no checksum manifest to verify against")
    for line in manifest.read_text().splitlines():
        if not line.strip():
            continue
        digest, fname = line.split(maxsplit=1)
        fname = fname.lstrip("*")
        path = model_dir / fname
        if not path.exists():
            raise CheckpointError(f"shard {fname} named in {CHECKSUM_FILE} does not exist")
        if sha256_file(path) != digest.lower():
            raise CheckpointError(f"shard {fname}: sha256 does not match {CHECKSUM_FILE} (corrupted or altered)")


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def load_checkpoint(model: torch.nn.Module, model_dir: str | Path, progress: bool = True,
                    verify: bool = False) -> None:
    model_dir = Path(model_dir)
    cfg: ModelConfig = model.config
    if verify:
        verify_checksums(model_dir)
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    for shard in tqdm(_shards(model_dir), desc="loading shards", unit="shard", disable=not progress):
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for raw_name in f.keys():
                    name = _canonical(raw_name, cfg)
                    if _is_ignored(name, cfg):
                        continue
                    target = targets.get(name)
                    if target is None:
                        raise CheckpointError(f"unexpected tensor {raw_name} in shard {shard.name}: "
                                              f"the {cfg.model_type} model has no such parameter")
                    if name in loaded:
                        raise CheckpointError(f"tensor {raw_name} appears twice (again in shard {shard.name})")
                    _copy_into(raw_name, f.get_tensor(raw_name), target, cfg)
                    loaded.add(name)
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types for damaged files
            raise CheckpointError(f"shard {shard.name} is unreadable or truncated: {exc}") from exc
    missing = [n for n in targets if n not in loaded]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor {missing[0]}: not in any shard; missing: {missing[:5]}{more}")


# ---- random weights in checkpoint layout (dummy load format, make-model) ----------------------

def checkpoint_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """The dtype the real checkpoints store this tensor in (model-spec §3)."""
    if name.endswith((".weight_packed", ".weight_scale")):
        return torch.uint8
    if name.endswith((".A_log", ".dt_bias", ".e_score_correction_bias")):
        return torch.float32
    if cfg.model_type == "kimi_k3" and name.endswith(("_conv1d.weight", ".o_norm.weight")):
        return torch.float32
    return torch.bfloat16


def _full_shape(name: str, target: Target, cfg: ModelConfig) -> tuple[int, ...]:
    if name.endswith("_conv1d.weight"):
        return (target.shape[0], 1, target.shape[1])
    if name.endswith(".A_log") and cfg.model_type == "kimi_linear":
        return (1, 1, cfg.kda_num_heads, 1)
    return target.shape


def random_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, device=None) -> torch.Tensor:
    """A deterministic random tensor for checkpoint tensor ``name``, scaled so a random model
    stays numerically tame (unit-ish activations, decays in range, valid MXFP4 scales)."""
    gen = torch.Generator(device=device or "cpu")
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    kw = dict(generator=gen, device=device)
    dtype = checkpoint_dtype(name, cfg)
    if name.endswith(".weight_packed"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, **kw)
    if name.endswith(".weight_scale"):
        fan_in = shape[-1] * 32
        base = 127 + int(round(torch.log2(torch.tensor(fan_in ** -0.5 / 2.5)).item()))
        return torch.randint(base - 1, base + 2, shape, dtype=torch.uint8, **kw)
    if name.endswith(".A_log"):
        return torch.empty(shape, device=device).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
    if name.endswith(".dt_bias"):
        dt = torch.empty(shape, device=device).uniform_(-6.9, -2.3, generator=gen).exp()
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)  # inverse softplus
    if name.endswith(".e_score_correction_bias"):
        return (torch.randn(shape, **kw) * 0.05).to(dtype)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1.0 + 0.1 * torch.randn(shape, **kw)).to(dtype)
    if name.endswith("_conv1d.weight"):
        return (torch.randn(shape, **kw) * 0.5).to(dtype)
    if name.endswith("res_proj.weight"):
        return (torch.randn(shape, **kw) * shape[-1] ** -0.5).to(dtype)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, **kw).to(dtype)
    return (torch.randn(shape, **kw) * shape[-1] ** -0.5).to(dtype)  # linears: fan-in scaling


def random_checkpoint(model: torch.nn.Module, seed: int, device=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of the model's checkpoint, in the real layout."""
    cfg = model.config
    for name, target in checkpoint_targets(model).items():
        yield name, random_tensor(name, _full_shape(name, target, cfg), cfg, seed, device)


def load_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """vLLM's --load-format dummy: random weights generated on the parameters' device, no files."""
    cfg = model.config
    targets = checkpoint_targets(model)
    for name, target in targets.items():
        t = random_tensor(name, _full_shape(name, target, cfg), cfg, seed, target.param.device)
        _copy_into(name, t, target, cfg)

"""``k3serve make-model``: a random-weight checkpoint in the real on-disk layout.

config.json, safetensors shards + model.safetensors.index.json, a sha256 manifest, and tokenizer
files in the Kimi layout (tiktoken.model + tokenizer_config.json). Tensors are generated and
written one shard at a time, so presets larger than RAM can be written; the same per-tensor
generator backs the ``dummy`` load format, so loading the files equals a dummy load on CPU.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .config import ModelConfig
from .model.k3 import K3ForCausalLM
from .model.weights import CHECKSUM_FILE, random_checkpoint, sha256_file
from .presets import K3_SPECIAL_BASE, preset_config

_K3_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
                6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
                19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 254: "[UNK]", 255: "[PAD]"}
_KIMI_LINEAR_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                         6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                         11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>",
                         13: "<|tool_call_begin|>", 14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>",
                         17: "<|im_middle|>", 254: "[UNK]", 255: "[PAD]"}


def special_tokens(cfg: ModelConfig) -> dict[int, str]:
    """The 256 reserved ids at the top of the vocabulary, named as the family names them."""
    base = cfg.vocab_size - 256
    names = _K3_SPECIALS if cfg.model_type == "kimi_k3" else _KIMI_LINEAR_SPECIALS
    return {base + i: names.get(i, f"<|reserved_token_{K3_SPECIAL_BASE + i}|>") for i in range(256)}


def write_tokenizer(cfg: ModelConfig, out: Path) -> None:
    """A byte-level tiktoken vocabulary (256 byte ranks; random models need no merges) plus the
    special-token table in tokenizer_config.json, as the Kimi models ship them."""
    lines = [f"{base64.b64encode(bytes([b])).decode()} {b}" for b in range(256)]
    (out / "tiktoken.model").write_text("\n".join(lines) + "\n")
    specials = special_tokens(cfg)
    base = cfg.vocab_size - 256
    tok_cfg = {
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": specials[base], "eos_token": specials[cfg.eos_token_ids[0]] if cfg.eos_token_ids else None,
        "pad_token": specials[base + 255], "unk_token": specials[base + 254],
        "model_max_length": cfg.max_position_embeddings,
        "added_tokens_decoder": {str(i): {"content": s, "special": True} for i, s in specials.items()},
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1) + "\n")


def write_checkpoint(raw_config: dict, out_dir: str | Path, seed: int = 0,
                     max_shard_bytes: int = 2 << 30, progress: bool = True) -> Path:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a directory")
    stale = sorted(p.name for p in out.glob("*.safetensors*")) if out.is_dir() else []
    if stale:  # (a new checkpoint's shards beside an old one's do not load: a tensor "appears twice")
        shown = ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else "")
        raise FileExistsError(f"{out} already holds a checkpoint ({shown}): remove it or choose another --out")
    if max_shard_bytes < 1:
        raise ValueError(f"the shard size must be > 0 bytes, got {max_shard_bytes}")
    out.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(raw_config)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
    gen_cfg = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id}
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
    write_tokenizer(cfg, out)
    skeleton = K3ForCausalLM(cfg, torch.bfloat16, device="meta")  # shapes only, no memory
    current: dict[str, torch.Tensor] = {}
    shard_names: list[list[str]] = []
    size = total = 0

    def flush() -> None:
        save_file(current, str(out / f".shard-{len(shard_names):05d}.tmp"), metadata={"format": "pt"})
        shard_names.append(list(current))
        current.clear()

    for name, t in tqdm(random_checkpoint(skeleton, seed), desc="writing tensors", disable=not progress):
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        current[name] = t
        size += nbytes
        total += nbytes
    flush()
    n = len(shard_names)
    weight_map = {}
    for i, names in enumerate(shard_names):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (out / f".shard-{i:05d}.tmp").rename(out / final)
        weight_map.update({k: final for k in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    files = sorted(set(weight_map.values()))
    (out / CHECKSUM_FILE).write_text("".join(f"{sha256_file(out / f)}  {f}\n" for f in files))
    return out


def make_model(preset: str, out_dir: str | Path, seed: int = 0, mxfp4: bool | None = None,
               max_shard_bytes: int = 2 << 30, progress: bool = True) -> Path:
    return write_checkpoint(preset_config(preset, mxfp4=mxfp4), out_dir, seed, max_shard_bytes, progress)

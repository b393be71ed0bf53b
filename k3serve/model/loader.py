"""Model construction: config -> uninitialised module on the device -> weights (files or dummy)."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from ..config import ModelConfig
from ..presets import preset_config
from .k3 import K3ForCausalLM
from .weights import load_checkpoint, load_dummy

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
           "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """'auto' / None: bf16 on CUDA (the checkpoints' dtype), fp32 on CPU (exact reference runs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose from auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def load_model(model: str | Path | None = None, *, preset: str | None = None, load_format: str = "auto",
               dtype: str | torch.dtype | None = "auto", device: str | torch.device | None = None,
               seed: int = 0, verify_checksums: bool = False, progress: bool = True,
               mxfp4: bool | None = None, quantization: str | None = None) -> K3ForCausalLM:
    """Build the network and fill its weights.

    ``model`` is a checkpoint directory; ``preset`` names a built-in shape (random weights only).
    ``load_format``: ``safetensors`` (read files), ``dummy`` (random weights generated on the device,
    no files), or ``auto`` (safetensors for a directory, dummy for a preset). ``mxfp4`` forces a
    preset's routed experts to MXFP4 (True) or bf16 (False). ``quantization="mxfp4"`` serves bf16
    routed experts in MXFP4, quantised as they load (``ModelConfig.with_quantization``).
    """
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if (model is None) == (preset is None):
        raise ValueError("give exactly one of a model directory or a preset")
    cfg = ModelConfig.from_pretrained(model) if model is not None else ModelConfig.from_dict(preset_config(preset, mxfp4))
    cfg = cfg.with_quantization(quantization)
    if load_format == "auto":
        load_format = "safetensors" if model is not None else "dummy"
    if load_format not in ("safetensors", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}: safetensors, dummy or auto")
    if load_format == "safetensors" and model is None:
        raise ValueError("load_format 'safetensors' needs a model directory")
    net = K3ForCausalLM(cfg, resolve_dtype(dtype, device), device)
    t0 = time.perf_counter()
    if load_format == "dummy":
        load_dummy(net, seed)
    else:
        load_checkpoint(net, model, progress=progress, verify=verify_checksums)
    if cfg.experts_quantized_at_load:
        log.info("routed experts quantised to MXFP4 as they loaded (--quantization mxfp4; %.1f s with the load)",
                 time.perf_counter() - t0)
    net.fuse_projections()
    return net.eval()

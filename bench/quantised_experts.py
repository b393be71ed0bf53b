"""kimi-linear's routed experts as ``--quantization mxfp4`` serves them, filled with random weights
(quantised MXFP4 codes, rows scaled by 1/sqrt(K)): what the GPU checks and the Nsight probe run."""

from __future__ import annotations

import dataclasses

import torch

from k3serve.config import ModelConfig
from k3serve.model.moe import RoutedExperts
from k3serve.ops.mxfp4 import quantize_mxfp4
from k3serve.presets import preset_config


def kimi_quantised_experts(gen: torch.Generator, num_experts: int | None = None) -> tuple[ModelConfig, RoutedExperts]:
    """(kimi-linear-48b's config, with ``num_experts`` where given; its MXFP4 expert stacks on gen's device)."""
    cfg = ModelConfig.from_dict(preset_config("kimi-linear-48b"))
    if num_experts is not None:
        cfg = dataclasses.replace(cfg, num_experts=num_experts)
    ex = RoutedExperts(cfg.with_quantization("mxfp4"), cfg.hidden_size, torch.bfloat16, gen.device)
    for n in ("w1", "w2", "w3"):
        p, s = getattr(ex, f"{n}_packed"), getattr(ex, f"{n}_scale")
        k = p.shape[2] * 2
        p.data, s.data = quantize_mxfp4(torch.randn(ex.num_experts, p.shape[1], k, device=gen.device, generator=gen)
                                        * k ** -0.5)
    return cfg, ex

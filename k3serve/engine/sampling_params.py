"""Per-request sampling settings, with vLLM's names and semantics."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context limit
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in prompt or output
    presence_penalty: float = 0.0  # OpenAI: subtract once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the generated text
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob + k top alternatives
    # None: none; k >= 0: every prompt token's logprob given the tokens before it (+ k top
    # alternatives; the first token has none). Such a prompt is computed whole: no prefix-cache hit.
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None  # OpenAI's: added to those tokens' logits, each in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's: every other token is excluded
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests with the same salt
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:  # (OpenAI sends the token ids as JSON object keys: strings)
            try:
                self.logit_bias = {int(t): v for t, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                 f"{name} must be a finite number, got {value!r}")
        need(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                   and -2**63 <= self.seed < 2**64), f"seed must be a 64-bit integer, got {self.seed!r}")
        need(isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        need(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        need(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        need(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        need(self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        need(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        need(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            need(value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 20),
                 f"{name} must be in 0..20, got {value!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings")
        need(all(t >= 0 and isinstance(v, (int, float)) and not isinstance(v, bool) and -100 <= v <= 100
                 for t, v in (self.logit_bias or {}).items()),
             "logit_bias must map token ids to biases in [-100, 100]")
        need(self.cache_salt is None or (isinstance(self.cache_salt, str) and self.cache_salt != ""),
             "cache_salt must be a non-empty string")
        need(self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be token ids")


# generation_config.json's fields a request's omitted settings default to (vLLM's --generation-config
# auto), with their SamplingParams names.
GENERATION_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                     "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_dir: str | Path | None, source: str = "auto", override: dict | None = None) -> dict:
    """The sampling defaults a model's creator recommends: ``source`` "auto" reads the model's
    generation_config.json, "vllm" (or no model directory) none, else a directory holding one;
    ``override`` (--override-generation-config) wins over both. SamplingParams names; a bad file
    or value is refused here, at start-up, not in a request."""
    raw: dict = {}
    if source == "vllm":
        folder = None
    elif source == "auto":
        folder = Path(model_dir) if model_dir is not None else None
    else:
        folder = Path(source)
    if folder is not None:
        path = folder / "generation_config.json"
        if source != "auto" and not path.is_file():
            raise ValueError(f"--generation-config {source}: no generation_config.json there")
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}: not valid JSON ({exc})") from None
            if not isinstance(raw, dict):
                raise ValueError(f"{path}: not a JSON object")
    unknown = sorted(set(override or {}) - set(GENERATION_FIELDS))
    if unknown:
        raise ValueError(f"--override-generation-config: {', '.join(unknown)} not among {', '.join(GENERATION_FIELDS)}")
    raw = {**raw, **(override or {})}
    defaults = {name: raw[key] for key, name in GENERATION_FIELDS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generation config: {exc}") from None
    return defaults

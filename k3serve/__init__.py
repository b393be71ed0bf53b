"""k3serve: a serving engine for the Kimi K3 model family."""

from .engine.engine import LLM, LLMEngine, EngineConfig, RequestOutput  # noqa: F401
from .engine.sampling_params import SamplingParams  # noqa: F401

__version__ = "0.1.0"

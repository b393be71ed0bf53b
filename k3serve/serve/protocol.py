"""OpenAI request bodies (pydantic) and their mapping to SamplingParams.

Unknown fields are allowed (clients send many); known fields are type-checked, and any bad value
becomes a 400 with an OpenAI-style error body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # (vLLM's: usage so far on every chunk)


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # (vLLM's)
    cache_salt: str | None = None  # (vLLM's: prefix-cache hits only within the salt)
    priority: int = 0  # (vLLM's: under --scheduling-policy priority, lower runs first)
    request_id: str | None = None  # (vLLM's: the request's id, also read from the X-Request-Id header)
    # vLLM-style extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # (vLLM's newer form of the guided_* fields)
    truncate_prompt_tokens: int | None = None  # (vLLM's: keep the prompt's last k tokens; -1: all that fit)
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None  # (vLLM's: every prompt token's logprob, in the response)
    return_tokens_as_token_ids: bool | None = None  # (vLLM's: logprobs name tokens "token_id:N"; None: the server's)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, default_max: int,
                        defaults: dict | None = None) -> SamplingParams:
        """``defaults``: what an omitted setting takes (the model's generation config, SamplingParams
        names; its max_tokens caps ``default_max``), else SamplingParams' own."""
        d = defaults or {}
        own = lambda name: getattr(self, name) if getattr(self, name) is not None else d.get(name)  # noqa: E731
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        default_max = min(default_max, d.get("max_tokens", default_max))
        return SamplingParams(
            n=self.n, max_tokens=max_tokens if max_tokens is not None else default_max,
            min_tokens=self.min_tokens, temperature=1.0 if own("temperature") is None else own("temperature"),
            top_p=1.0 if own("top_p") is None else own("top_p"), top_k=own("top_k") or 0,
            min_p=own("min_p") or 0.0,
            repetition_penalty=1.0 if own("repetition_penalty") is None else own("repetition_penalty"),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=stop, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids, cache_salt=self.cache_salt,
            include_stop_str_in_output=self.include_stop_str_in_output)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}

"""A request's lifecycle state: tokens, cache ownership, sampling state, finish reason."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # not admitted, or preempted (its cache freed; recomputed on readmission)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One generated sample. A request with n > 1 has n sequences that share the prompt's
    prefill: sample 0 computes it, the others start from copies of its state."""

    request_id: str
    index: int
    token_ids: list[int]  # prompt + generated
    num_prompt: int
    params: SamplingParams
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose state is in the cache
    kda_slot: int | None = None
    pages: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit skipped on admission (vLLM's)
    priority: int = 0  # the priority scheduling policy's: lower runs first (vLLM's)
    pending_checkpoint: bool = False  # prefix cache: prompt-end state not yet snapshotted
    # Filled by the engine's output processing
    # The answer's text in the pieces it was produced in: appending a piece is O(1), where
    # ``str +=`` on an attribute copies the whole answer every token.
    text_pieces: list[str] = field(default_factory=list)
    emitted_tokens: int = 0
    emitted_pieces: int = 0
    logprobs: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    # params.prompt_logprobs (sample 0, which computes the prompt): one entry a prompt token scored so
    # far, None for the first, else (token_id, logprob, [(alt_id, alt_logprob), ...], rank)
    prompt_logprobs: list = field(default_factory=list)
    detok: object | None = None
    stopper: object | None = None
    grammar: object | None = None  # per-sample grammar matcher state (structured output)
    # Overlapped scheduling: (launched step, its row, position) of a token still on the device,
    # and whether that token ends the sequence whatever it is (max_tokens / max_model_len).
    pending: tuple | None = None
    awaiting_final: bool = False

    @property
    def text(self) -> str:
        """The answer's text so far (joined on demand: once for a delta-output stream's final output)."""
        return "".join(self.text_pieces)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def scoring_prompt(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prompt must be computed here, whole."""
        return self.params.prompt_logprobs is not None and self.index == 0 and len(self.prompt_logprobs) < self.num_prompt

    @property
    def is_decode(self) -> bool:
        return self.num_computed == self.num_tokens - 1


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    prompt_text: str | None = None
    forked: bool = False  # n > 1: siblings received the prompt state
    scored_sent: bool = False  # delta outputs: the prompt logprobs went out (they go once)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


def new_request(request_id: str, prompt_ids: list[int], params: SamplingParams, prompt_text: str | None = None,
                device: torch.device | str = "cpu", priority: int = 0) -> Request:
    seqs = []
    for i in range(params.n):
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed + i)
        seqs.append(Sequence(request_id, i, list(prompt_ids), len(prompt_ids), params, gen, priority=priority))
    if params.prompt_logprobs is not None:
        seqs[0].prompt_logprobs.append(None)  # (the first token has nothing before it)
    return Request(request_id, list(prompt_ids), params, seqs, prompt_text)

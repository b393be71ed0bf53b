"""The engine in its own process, driven by typed messages over two pipes.

With the engine loop on a thread of the HTTP server's process, the event loop (HTTP parsing, SSE
chunks, JSON, metrics for every streamed token) and the engine's host work took turns on one GIL:
behind the server, kimi-linear-48b's median time between tokens at concurrency 256 was 49 ms
against 30 ms for the same workload on the engine alone (RESULTS.md thirty-fifth session). Here
the engine owns a process (vLLM's EngineCore, SGLang's scheduler process): it runs steps back to
back and sends each step's output deltas as one message; the server process
(async_engine.AsyncLLM) turns them back into cumulative RequestOutputs.

Messages to the engine: AddRequest, Abort, AbortAll, StatsQuery (which may first empty the prefix
cache), Stop. From it: Ready or
StartupFailed once, then StepOutputs, RequestFailed, StatsReply, EngineFailed. A step's outputs
travel as plain tuples (``OutputDelta``): only what is new, so a message does not grow with the
length of the answers.
"""

from __future__ import annotations

import argparse
import gc
import logging
import pickle
import signal
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class EngineInfo:
    """What the server process needs to know of the engine it does not hold."""
    model_type: str
    vocab_size: int
    max_model_len: int
    structured_output: bool  # a grammar backend runs in the engine process


# ---- to the engine ----------------------------------------------------------------------------
@dataclass
class AddRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    grammar: object = None  # a serve.grammar.GrammarSpec, compiled in the engine process
    priority: int = 0


@dataclass
class Abort:
    request_id: str


@dataclass
class AbortAll:
    reason: str


@dataclass
class StatsQuery:
    token: int
    reset_prefix_cache: bool = False  # (vLLM's /reset_prefix_cache: benchmarks start cold)


@dataclass
class Stop:
    pass


# ---- from the engine --------------------------------------------------------------------------
@dataclass
class Ready:
    info: EngineInfo


@dataclass
class StartupFailed:
    error: BaseException


# One sequence's news of a step: (index, delta_text, delta_token_ids, finish_reason, stop_reason,
# logprobs of the delta's tokens or None); a request's: (request_id, finished, [SeqDelta, ...],
# prompt logprobs: on the one output that carries them, else None; prompt tokens read from the prefix
# cache).
SeqDelta = tuple
OutputDelta = tuple


@dataclass
class StepOutputs:
    outputs: list[OutputDelta]
    waiting: int  # requests the engine holds that have not started (queued or compiling a grammar)
    adds_seen: int  # AddRequest messages received so far


@dataclass
class RequestFailed:
    request_id: str
    error: BaseException


@dataclass
class StatsReply:
    token: int
    stats: dict


@dataclass
class EngineFailed:
    error: str


def output_delta(out: RequestOutput) -> OutputDelta:
    """``out`` from ``LLMEngine.step(cumulative=False)``: its logprobs are the new tokens' alone."""
    return out.request_id, out.finished, [(o.index, o.delta_text, o.delta_token_ids, o.finish_reason, o.stop_reason,
                                           o.logprobs) for o in out.outputs], \
        out.prompt_logprobs, out.num_cached_tokens


def picklable(exc: BaseException) -> BaseException:
    """The exception itself where it crosses a pipe intact, else a RuntimeError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def engine_stats(engine: LLMEngine) -> dict:
    """The gauges /metrics shows, read where the engine lives."""
    from .request import Sequence

    st = engine.pool.stats()
    return dict(running=len(engine.scheduler.running), waiting=len(engine.scheduler.waiting),
                kda_bytes=st["kda_bytes"], mla_bytes=st["mla_bytes"], used_bytes=st["used_bytes"],
                total_bytes=st["total_bytes"], preemptions=engine.scheduler.num_preemptions,
                step_kinds=engine.step_kinds(), scheduled_tokens=engine.scheduled_tokens(),
                prefix=engine.prefix_stats(),
                request_bytes=engine.scheduler.owners.bytes_held(lambda h: isinstance(h, Sequence)))


class EngineLoop:
    """Commands in, steps run back to back while there is work, each step's outputs out."""

    IDLE_POLL_S = 0.05
    BURST_MAX_S = 0.02  # the longest an idle engine waits, from its first arrival, for the rest of a burst
    DEFAULT_BURST_GAP_S = 0.005

    def __init__(self, engine: LLMEngine, grammar_backend, commands, outputs,
                 burst_gap_s: float = DEFAULT_BURST_GAP_S, clock=time.monotonic):
        self.engine = engine
        # An idle engine's first arrival often heads a burst (a client's wave of requests, each parsed
        # in turn by the server): it waits while the next arrives within burst_gap_s (at most
        # BURST_MAX_S), so the burst is prefilled in one step rather than one step each few requests
        # (each prompt step reads every expert's weights). A wait that finds no company marks the
        # traffic lone: later first arrivals step at once, until a request comes within BURST_MAX_S of
        # one (waited for or not), which marks it bursty again. So a lone client pays the gap once,
        # not every request. 0: never wait, as vLLM's engine core.
        self.burst_gap_s, self.clock = burst_gap_s, clock
        self.bursty, self.first_arrival = True, -float("inf")
        self.grammar_backend = grammar_backend
        self.commands, self.outputs = commands, outputs
        self.compiling: dict[str, tuple[AddRequest, Future]] = {}  # requests waiting on their grammar
        self.adds_seen = 0

    def run(self) -> None:
        try:
            while self._drain():
                self._admit_compiled()
                if not self.engine.has_unfinished_requests():
                    continue
                outs = self.engine.step(cumulative=False)
                if outs:
                    self.outputs.send(StepOutputs([output_delta(o) for o in outs],
                                                  len(self.engine.scheduler.waiting) + len(self.compiling),
                                                  self.adds_seen))
        except BaseException as exc:  # a broken engine must not leave the server's clients hanging
            log.exception("engine loop failed")
            try:
                self.outputs.send(EngineFailed(f"{type(exc).__name__}: {exc}"))
            except OSError:
                pass

    def _drain(self) -> bool:
        """Handles every queued command (waiting a little when there is nothing to do); False once
        told to stop or once the server process is gone."""
        idle = not self.engine.has_unfinished_requests()
        timeout = (0.005 if self.compiling else self.IDLE_POLL_S) if idle else 0.0
        burst_end, wait_until, arrived = None, None, 0
        while self.commands.poll(timeout):
            try:
                msg = self.commands.recv()
            except EOFError:
                return False
            if isinstance(msg, Stop):
                return False
            self._handle(msg)
            if isinstance(msg, AddRequest) and self.burst_gap_s > 0:
                now = self.clock()
                if idle and arrived == 0:  # the first arrival at an idle engine
                    self.first_arrival = now
                    if self.bursty:
                        burst_end = now + self.BURST_MAX_S
                elif now - self.first_arrival <= self.BURST_MAX_S:  # company for it, waited for or not
                    self.bursty = True
                arrived += 1
                if burst_end is not None:
                    wait_until = min(now + self.burst_gap_s, burst_end)
            # (other commands, a stats query say, neither cut a wait short nor extend it)
            timeout = 0.0 if wait_until is None else max(0.0, wait_until - self.clock())
        if burst_end is not None and arrived < 2:
            self.bursty = False
        return True

    def _handle(self, msg) -> None:
        if isinstance(msg, AddRequest):
            self.adds_seen += 1
            if msg.grammar is None:
                self._add(msg, None)
            elif self.grammar_backend is None:
                self._fail(msg.request_id, ValueError("structured output is not available on this server"))
            else:
                self.compiling[msg.request_id] = (msg, self.grammar_backend.compile_async(msg.grammar))
        elif isinstance(msg, Abort):
            if self.compiling.pop(msg.request_id, None) is None:
                self.engine.abort_request(msg.request_id)
        elif isinstance(msg, AbortAll):
            for rid in list(self.engine.requests) + list(self.compiling):
                self.compiling.pop(rid, None)
                self.engine.abort_request(rid)
                self._fail(rid, RuntimeError(msg.reason))
        elif isinstance(msg, StatsQuery):
            if msg.reset_prefix_cache and self.engine.prefix is not None:
                self.engine.prefix.clear()
            self.outputs.send(StatsReply(msg.token, engine_stats(self.engine)))
        else:
            raise TypeError(f"unknown engine command {msg!r}")

    def _admit_compiled(self) -> None:
        for rid in [r for r, (_, fut) in self.compiling.items() if fut.done()]:
            msg, fut = self.compiling.pop(rid)
            try:
                grammar = fut.result()
            except Exception as exc:  # GrammarError: the request's constraint is invalid
                self._fail(rid, exc)
            else:
                self._add(msg, grammar)

    def _add(self, msg: AddRequest, grammar) -> None:
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.request_id,
                                    prompt_text=msg.prompt_text, grammar=grammar, priority=msg.priority)
        except ValueError as exc:  # RequestRejected and kin: this request can't run
            self._fail(msg.request_id, exc)

    def _fail(self, rid: str, exc: BaseException) -> None:
        self.outputs.send(RequestFailed(rid, picklable(exc)))


def grammar_backend_for(engine: LLMEngine, enabled: bool):
    """xgrammar over the engine's tokenizer, or None (no tokenizer, turned off, xgrammar missing)."""
    if engine.tokenizer is None or not enabled:
        return None
    try:
        from ..serve.grammar import GrammarBackend
        from ..serve.tool_grammar import K3_MARKERS
    except ImportError as exc:
        log.warning("structured output disabled: %s", exc)
        return None
    markers = tuple(i for m in K3_MARKERS if (i := engine.tokenizer.special_tokens.get(m)) is not None)
    return GrammarBackend(engine.tokenizer, engine.model.config.vocab_size, marker_ids=markers)


def run_engine_process(args: argparse.Namespace, commands, outputs) -> None:
    """The engine process's main: build the engine from the server's arguments, say Ready (or
    why not), then loop. Ctrl-C reaches the whole process group: the server process stops this
    one (Stop, or its end of the pipe closing), so the engine ignores SIGINT mid-step."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import threading

    import tqdm

    tqdm.tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock: a semaphore left at exit
    from ..cli import engine_from_args

    try:
        engine = engine_from_args(args)
        backend = grammar_backend_for(engine, not args.no_structured_output)
    except BaseException as exc:
        outputs.send(StartupFailed(picklable(exc)))
        return
    cfg = engine.model.config
    outputs.send(Ready(EngineInfo(cfg.model_type, cfg.vocab_size, engine.max_model_len, backend is not None)))
    gap_s = EngineLoop.DEFAULT_BURST_GAP_S if args.burst_gap_ms is None else args.burst_gap_ms / 1e3
    gc.freeze()  # the model's and the pool's objects: not rescanned by a full collection between steps
    try:
        EngineLoop(engine, backend, commands, outputs, burst_gap_s=gap_s).run()
    finally:
        gc.unfreeze()  # collectable again at exit (Triton's bindings report objects left as leaks)

"""AsyncLLM: the server process's handle on the engine process (engine_process.py), for asyncio.

The engine runs in its own process so that neither the event loop nor the engine's host work waits
on the other's GIL. Commands go out through a sender thread (a busy engine must never block the
event loop on a full pipe); a reader thread hands each step's message to the event loop in one
``call_soon_threadsafe``, where it becomes one cumulative RequestOutput per request, as
``LLMEngine.step`` gives them.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import multiprocessing as mp
import queue
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator

from . import engine_process as msgs
from .engine import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import RequestRejected, check_prompt_length

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows (HTTP 503)."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    prompt_ids: list[int]
    prompt_text: str | None
    pieces: dict[int, list[str]] = field(default_factory=dict)  # per sequence index: its text deltas
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, list] = field(default_factory=dict)
    prompt_logprobs: list | None = None  # (sent once by the engine; every output after carries them)

    def output(self, rid: str, finished: bool, seqs: list, prompt_logprobs: list | None,
               num_cached_tokens: int) -> RequestOutput:
        """The request's output after one step's deltas. token_ids / logprobs are the stream's
        growing lists (no copy a step); ``text`` is the whole answer on the final output only
        (joined once, not re-copied every step: streams read ``delta_text``), "" before."""
        outs = []
        for index, delta_text, delta_ids, finish_reason, stop_reason, lps in seqs:
            pieces = self.pieces.setdefault(index, [])
            pieces.append(delta_text)
            ids = self.token_ids.setdefault(index, [])
            ids += delta_ids
            all_lps = None
            if lps is not None:
                all_lps = self.logprobs.setdefault(index, [])
                all_lps += lps
            outs.append(CompletionOutput(index, "".join(pieces) if finished else "", ids, finish_reason, stop_reason,
                                         all_lps, delta_text, delta_ids))
        self.prompt_logprobs = prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs
        return RequestOutput(rid, self.prompt_text, self.prompt_ids, outs, finished, self.prompt_logprobs,
                             num_cached_tokens)


class AsyncLLM:
    def __init__(self, commands, outputs, process, info: msgs.EngineInfo, max_queue: int | None = None):
        self.info = info
        self.max_queue = max_queue
        self.errored: BaseException | None = None
        self._commands, self._outputs, self._process = commands, outputs, process
        self._streams: dict[str, _Stream] = {}
        self._stats: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count()
        self._waiting = self._adds_sent = self._adds_seen = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_set = threading.Event()
        self._closing = False
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write, name="k3serve-engine-send", daemon=True).start()
        threading.Thread(target=self._read, name="k3serve-engine-recv", daemon=True).start()

    @classmethod
    def start(cls, args: argparse.Namespace, max_queue: int | None = None) -> "AsyncLLM":
        """Spawns the engine process from the server's arguments and waits until it is ready;
        raises what stopped its start-up (a bad checkpoint, an unfitting layout...)."""
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        cmd_recv, cmd_send = ctx.Pipe(duplex=False)
        out_recv, out_send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=msgs.run_engine_process, args=(args, cmd_recv, out_send), name="k3serve-engine",
                           daemon=True)
        proc.start()
        cmd_recv.close()
        out_send.close()
        try:
            msg = out_recv.recv()
        except EOFError:
            proc.join(5)
            raise RuntimeError(f"the engine process exited during start-up (exit code {proc.exitcode})") from None
        if isinstance(msg, msgs.StartupFailed):
            proc.join(30)
            raise msg.error
        return cls(cmd_send, out_recv, proc, msg.info, max_queue)

    # ---- called from the event loop ------------------------------------------------------
    def num_waiting(self) -> int:
        """Requests not started: queued in the engine, or sent and not yet seen by it."""
        return self._waiting + self._adds_sent - self._adds_seen

    def check_admissible(self, prompt_ids: list[int]) -> None:
        """Raises RequestRejected for a prompt no engine of this length limit could take (the server
        asks before ``generate``; the engine refuses the rest, a prompt larger than the whole pool
        among them, as the request's first output)."""
        check_prompt_length(len(prompt_ids), self.info.max_model_len)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None, grammar=None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """``grammar``: a serve.grammar.GrammarSpec; the engine process compiles it, and a bad one
        is raised (GrammarError) as the first output."""
        self._attach()
        if self.errored is not None:
            raise RuntimeError(f"the engine has stopped: {self.errored}")
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFull(f"{self.num_waiting()} requests are already waiting (--max-queue {self.max_queue})")
        if request_id in self._streams:  # (a client's reused X-Request-Id: the running one keeps its stream)
            raise RequestRejected(f"request id {request_id!r} is already in use")
        stream = _Stream(asyncio.Queue(), list(prompt_ids), prompt_text)
        self._streams[request_id] = stream
        self._adds_sent += 1
        self._outbox.put(msgs.AddRequest(request_id, stream.prompt_ids, params, prompt_text, grammar, priority))
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if self._streams.pop(request_id, None) is not None:  # the consumer left early: free at once
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._outbox.put(msgs.Abort(request_id))

    async def stats(self, timeout: float = 30.0, reset_prefix_cache: bool = False) -> dict:
        """The engine's gauges (engine_process.engine_stats), read between two of its steps (after
        emptying the prefix cache of every checkpoint no running request holds, if asked)."""
        self._attach()
        if self.errored is not None:
            raise RuntimeError(f"the engine has stopped: {self.errored}")
        token = next(self._tokens)
        fut = self._loop.create_future()
        self._stats[token] = fut
        self._outbox.put(msgs.StatsQuery(token, reset_prefix_cache))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats.pop(token, None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still running and stop the engine process."""
        if self._closing:
            return
        self._closing = True
        self._outbox.put(msgs.AbortAll("the server is shutting down"))
        self._outbox.put(msgs.Stop())
        self._outbox.put(None)
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop in %.0f s: terminating it", timeout)
            self._process.terminate()
            self._process.join(5)

    def _attach(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop_set.set()

    def _dispatch(self, msg) -> None:
        if isinstance(msg, msgs.StepOutputs):
            self._waiting, self._adds_seen = msg.waiting, msg.adds_seen
            for rid, finished, seqs, *request_news in msg.outputs:
                stream = self._streams.get(rid)
                if stream is None:  # its consumer went away: the abort is on its way
                    continue
                if finished:
                    del self._streams[rid]
                stream.queue.put_nowait(stream.output(rid, finished, seqs, *request_news))
        elif isinstance(msg, msgs.RequestFailed):
            stream = self._streams.pop(msg.request_id, None)
            if stream is not None:
                stream.queue.put_nowait(msg.error)
        elif isinstance(msg, msgs.StatsReply):
            fut = self._stats.get(msg.token)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, msgs.EngineFailed):
            for stream in self._streams.values():
                stream.queue.put_nowait(RuntimeError(f"engine failure: {msg.error}"))
            self._streams.clear()
            for fut in self._stats.values():
                if not fut.done():
                    fut.set_exception(RuntimeError(f"engine failure: {msg.error}"))

    # ---- threads ---------------------------------------------------------------------------
    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._commands.send(msg)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        while True:
            try:
                msg = self._outputs.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                msg = msgs.EngineFailed(f"the engine process exited (exit code {self._process.exitcode})")
            if isinstance(msg, msgs.EngineFailed):
                log.error("engine failed: %s", msg.error)
                self.errored = RuntimeError(msg.error)
            self._loop_set.wait()
            try:
                self._loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the event loop has closed
                return
            if isinstance(msg, msgs.EngineFailed):
                return

"""AsyncLLM: the engine loop on its own thread, driven from asyncio.

The forward pass blocks for milliseconds to seconds; running it on the event loop would stall
every HTTP connection. Commands (add / abort) go to the engine thread through a queue; outputs
come back to each request's asyncio.Queue with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator

from .engine import LLMEngine, RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than --max-queue allows (HTTP 503)."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    arrival: float


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_queue: int | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="k3serve-engine", daemon=True)
        self.errored: BaseException | None = None
        self._thread.start()

    # ---- called from the event loop ------------------------------------------------------
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    def check_admissible(self, prompt_ids: list[int]) -> None:
        """Raises the engine's rejection (too long / larger than the pool) before queueing."""
        self.engine.scheduler.check_admissible(len(prompt_ids))

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                       prompt_text: str | None = None, grammar=None) -> AsyncIterator[RequestOutput]:
        if self.errored is not None:
            raise RuntimeError(f"the engine has stopped: {self.errored!r}")
        if self.max_queue is not None and self.num_waiting() >= self.max_queue:
            raise QueueFull(f"{self.num_waiting()} requests are already waiting (--max-queue {self.max_queue})")
        self.check_admissible(prompt_ids)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), time.monotonic())
        with self._lock:
            self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_ids, params, prompt_text, grammar))
        self._wake.set()
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            with self._lock:
                live = self._streams.pop(request_id, None) is not None
            if live:  # the consumer went away early (client disconnect, cancellation): free at once
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort everything still running and stop the engine thread."""
        self._commands.put(("abort_all",))
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)

    # ---- engine thread --------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None and (isinstance(item, BaseException) or item.finished):
                self._streams.pop(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, text, grammar = cmd
                try:
                    self.engine.add_request(ids, params, request_id=rid, prompt_text=text, grammar=grammar)
                except Exception as exc:  # rejected: tell the waiting coroutine
                    self._deliver(rid, exc)
            elif cmd[0] == "abort":
                self.engine.abort_request(cmd[1])
            elif cmd[0] == "abort_all":
                for rid in list(self.engine.requests):
                    self.engine.abort_request(rid)
                    self._deliver(rid, RuntimeError("the server is shutting down"))

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
            self._drain_commands()
        except BaseException as exc:  # a broken engine must not hang clients forever
            log.exception("engine loop failed")
            self.errored = exc
            with self._lock:
                rids = list(self._streams)
            for rid in rids:
                self._deliver(rid, RuntimeError(f"engine failure: {exc!r}"))

"""Runs the engine loop on its own thread; the asyncio side talks to it through a queue."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from worker.engine.engine import EngineStats, LLMEngine, PreparedRequest, SequenceOutput

logger = logging.getLogger(__name__)

OutputsCallback = Callable[[list[SequenceOutput]], None]
RejectCallback = Callable[[str, Exception], None]
T = TypeVar("T")


class EngineHost:
    """One daemon thread that runs, in order, every call handed to it: build the engine here
    (`submit(LLMEngine, config)`), then step it here (`EngineThread(..., host=host)`).

    Why: OpenMP keeps one team of helper threads per thread that starts parallel work, and
    with two teams libgomp stops spinning between matmuls (docs/benchmarks.md, "One OpenMP
    team").
    """

    def __init__(self, name: str = "engine") -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        self._calls.put((future, fn, args))
        return future

    def close(self) -> None:
        """Stop after the calls already submitted (a daemon: never blocks the process exit)."""
        self._calls.put(None)

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


class EngineStepError(RuntimeError):
    """A step raised: the requests in it fail (HTTP 500), the engine carries on."""


@dataclass
class _Add:
    prepared: PreparedRequest


@dataclass
class _Abort:
    request_id: str


class EngineThread:
    """Owns the engine: applies adds and aborts between steps, steps while there is work.

    `on_outputs` is called on the engine thread after every step with that step's outputs;
    it must only hand them over (e.g. `loop.call_soon_threadsafe`), never block. `host` is
    the thread the engine was built on (see `EngineHost`); without one it gets its own.
    `stats` is the engine's state as of its last step or command, published by the engine
    thread: the event loop and the heartbeat read it instead of calling into the engine.
    """

    def __init__(
        self,
        engine: LLMEngine,
        on_outputs: OutputsCallback,
        on_reject: RejectCallback,
        host: EngineHost | None = None,
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_reject = on_reject
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._host = host
        self._done: Future[None] | None = None
        self._stopping = threading.Event()
        self.num_steps = 0
        self.step_started_at: float | None = None  # monotonic; None between steps
        self.stats: EngineStats = engine.stats()  # the engine thread has not started yet

    def start(self) -> None:
        if self._host is None:
            self._host = EngineHost()
        self._done = self._host.submit(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        if self._host is not None:
            self._host.close()
        if self._done is not None:
            with contextlib.suppress(TimeoutError):  # a hung step: the thread is a daemon
                self._done.result(timeout)

    def stalled_for(self) -> float:
        """Seconds the current step has been running (0 between steps): a step that never
        ends (a hung kernel, a deadlock) shows here while the rest of the worker runs on."""
        started = self.step_started_at
        return time.monotonic() - started if started is not None else 0.0

    def add(self, prepared: PreparedRequest) -> None:
        self._commands.put(_Add(prepared))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            if self._stopping.is_set() or not self.engine.has_unfinished_requests():
                continue
            self.step_started_at = time.monotonic()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in a step must not hang or kill the worker
                logger.exception("engine step failed; failing its requests")
                self._fail_all(exc)
                continue
            finally:
                self.step_started_at = None
            self.num_steps += 1
            self.stats = self.engine.stats()
            if outputs:
                self._on_outputs(outputs)

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request the engine holds and report each as failed by the engine."""
        for request_id in self.engine.request_ids():
            self.engine.abort_request(request_id)
            self._on_reject(request_id, EngineStepError(f"engine step failed: {exc!r}"))
        self.stats = self.engine.stats()

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while command is not None:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self.stats = self.engine.stats()

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.prepared)
        except ValueError as exc:
            self._on_reject(command.prepared.request_id, exc)

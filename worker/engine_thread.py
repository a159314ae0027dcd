"""Runs the engine loop on its own thread; the asyncio side talks to it through a queue."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.engine.engine import LLMEngine, PreparedRequest, SequenceOutput

logger = logging.getLogger(__name__)

OutputsCallback = Callable[[list[SequenceOutput]], None]
RejectCallback = Callable[[str, Exception], None]


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
    it must only hand them over (e.g. `loop.call_soon_threadsafe`), never block.
    """

    def __init__(
        self, engine: LLMEngine, on_outputs: OutputsCallback, on_reject: RejectCallback
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_reject = on_reject
        self._commands: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = threading.Event()
        self.num_steps = 0
        self.step_started_at: float | None = None  # monotonic; None between steps

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(None)
        self._thread.join(timeout)

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
            if outputs:
                self._on_outputs(outputs)

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request the engine holds and report each as failed by the engine."""
        for request_id in self.engine.request_ids():
            self.engine.abort_request(request_id)
            self._on_reject(request_id, EngineStepError(f"engine step failed: {exc!r}"))

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
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort_request(command.request_id)
            return
        try:
            self.engine.add_request(command.prepared)
        except ValueError as exc:
            self._on_reject(command.prepared.request_id, exc)

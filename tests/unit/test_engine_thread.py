"""The engine thread applies commands between steps and survives a failing step."""

from __future__ import annotations

import threading

from worker.engine_thread import EngineHost, EngineStepError, EngineThread


class FlakyEngine:
    """Holds requests; its first step raises, later steps finish everything held."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self.num_steps = 0

    def add_request(self, prepared: object) -> None:
        self.held.append(prepared.request_id)  # type: ignore[attr-defined]

    def abort_request(self, request_id: str) -> bool:
        self.held.remove(request_id)
        return True

    def request_ids(self) -> list[str]:
        return list(self.held)

    def has_unfinished_requests(self) -> bool:
        return bool(self.held)

    def stats(self) -> int:
        return len(self.held)

    def step(self) -> list[str]:
        self.num_steps += 1
        if self.num_steps == 1:
            raise RuntimeError("boom")
        done, self.held = self.held, []
        return done


def threads_calling(engine: FlakyEngine, method: str) -> list[int]:
    """Wraps `engine.<method>` to record the thread of every call; returns that record."""
    callers: list[int] = []
    wrapped = getattr(engine, method)

    def call() -> object:
        callers.append(threading.get_ident())
        return wrapped()

    setattr(engine, method, call)
    return callers


class Prepared:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on() -> None:
    engine = FlakyEngine()
    rejected: list[tuple[str, Exception]] = []
    finished: list[str] = []
    done = threading.Event()

    def on_outputs(outputs: list[str]) -> None:
        finished.extend(outputs)
        done.set()

    thread = EngineThread(engine, on_outputs, lambda rid, exc: rejected.append((rid, exc)))
    thread.add(Prepared("a"))  # queued before the thread starts: both in the first step
    thread.add(Prepared("b"))
    thread.start()
    try:
        for _ in range(200):  # the first step fails and reports both requests
            if len(rejected) == 2:
                break
            threading.Event().wait(0.01)
        assert [rid for rid, _ in rejected] == ["a", "b"]
        assert all(isinstance(exc, EngineStepError) for _, exc in rejected)
        assert engine.held == []
        thread.add(Prepared("c"))
        assert done.wait(5)
        assert finished == ["c"]
    finally:
        thread.stop()


def test_the_engine_is_built_and_stepped_on_the_same_thread() -> None:
    """One OS thread for construction and steps: OpenMP then keeps one team (EngineHost)."""
    host = EngineHost()
    built_on = host.submit(threading.get_ident).result(timeout=5)
    engine = FlakyEngine()
    engine.num_steps = 1  # no failing first step here
    stepped_on = threads_calling(engine, "step")
    done = threading.Event()
    thread = EngineThread(engine, lambda outputs: done.set(), lambda rid, exc: None, host=host)
    thread.start()
    try:
        thread.add(Prepared("a"))
        assert done.wait(5)
        assert stepped_on and set(stepped_on) == {built_on}
        assert built_on != threading.get_ident()
    finally:
        thread.stop()
    host.thread.join(5)  # stop() closed the host: its thread ends
    assert not host.thread.is_alive()


def test_an_exception_in_a_hosted_call_reaches_the_caller() -> None:
    host = EngineHost()
    try:
        future = host.submit(int, "not a number")
        try:
            future.result(timeout=5)
        except ValueError as exc:
            assert "not a number" in str(exc)
        else:
            raise AssertionError("the ValueError was swallowed")
        assert host.submit(int, "7").result(timeout=5) == 7  # the thread carries on
    finally:
        host.close()


def test_stats_are_a_snapshot_published_by_the_engine_thread() -> None:
    """Others read `thread.stats`; only the engine thread calls `engine.stats()` once started."""
    engine = FlakyEngine()
    callers = threads_calling(engine, "stats")
    engine.num_steps, done = 1, threading.Event()
    thread = EngineThread(engine, lambda outputs: done.set(), lambda rid, exc: None)
    assert thread.stats == 0 and callers == [threading.get_ident()]  # before start: no race
    thread.add(Prepared("a"))
    thread.start()
    try:
        assert done.wait(5)
        assert thread.stats == 0  # the step finished "a", and the snapshot says so
        assert set(callers[1:]) == {thread._host.thread.ident}  # type: ignore[union-attr]
    finally:
        thread.stop()

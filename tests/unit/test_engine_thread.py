"""The engine thread applies commands between steps and survives a failing step."""

from __future__ import annotations

import threading

from worker.engine_thread import EngineStepError, EngineThread


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

    def step(self) -> list[str]:
        self.num_steps += 1
        if self.num_steps == 1:
            raise RuntimeError("boom")
        done, self.held = self.held, []
        return done


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

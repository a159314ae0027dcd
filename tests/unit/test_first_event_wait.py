"""A request's wait for its job's first event: behind a queue that a live worker serves it
waits on; with no live worker for its model it fails when the first-event timeout passes."""

from __future__ import annotations

import asyncio

import pytest

from api.openai.completions import _first_content
from shared.contracts import DeltaEvent, StartedEvent


class _Queued:
    """A subscription whose job starts after `waits` first-event timeouts."""

    def __init__(self, waits: int) -> None:
        self.waits = waits
        self.events = [
            StartedEvent(worker_id="w", prompt_tokens=3),
            DeltaEvent(text="hi", token_ids=[5]),
        ]

    async def next(self, timeout: float | None) -> tuple[str, object]:
        if self.waits:
            self.waits -= 1
            raise TimeoutError
        return "1-0", self.events.pop(0)


def _served(answer: bool, asked: list[int]):
    async def served() -> bool:
        asked.append(1)
        return answer

    return served


def test_a_queued_job_with_a_live_worker_waits_past_the_first_event_timeout() -> None:
    asked: list[int] = []
    events = asyncio.run(_first_content(_Queued(waits=3), 0.01, _served(True, asked)))
    assert [e.type for e in events] == ["started", "delta"]
    assert len(asked) == 3  # asked once per timeout


def test_with_no_live_worker_the_first_event_timeout_fails_the_request() -> None:
    asked: list[int] = []
    with pytest.raises(TimeoutError):
        asyncio.run(_first_content(_Queued(waits=1), 0.01, _served(False, asked)))
    assert asked == [1]

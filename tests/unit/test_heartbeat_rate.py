"""The worker record's tokens/s: generated tokens over the last few seconds of beats."""

from __future__ import annotations

import pytest

from shared.keys import Keys
from tests.support.records import worker_record
from worker import heartbeat as hb
from worker.engine.engine import EngineStats


def test_tokens_per_second_over_a_sliding_window(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = {"now": 100.0}
    count = {"tokens": 0}
    monkeypatch.setattr(hb.time, "monotonic", lambda: clock["now"])
    base = worker_record()
    beat = hb.Heartbeat(
        None,
        Keys("t"),
        base,
        1.0,
        5.0,  # type: ignore[arg-type]
        stats=lambda: EngineStats(0, 0, 0, 10, 16, 1, 0, 0, 0),
        job_ids=list,
        status=lambda: "ready",
        generated_tokens=lambda: count["tokens"],
    )
    assert beat.record().tokens_per_s == 0.0  # one sample: no rate yet
    rates = []
    for tokens in (10, 30, 60, 60, 60, 60):  # one beat per second
        clock["now"] += 1.0
        count["tokens"] = tokens
        rates.append(beat.record().tokens_per_s)
    # 10, 30/2, 60/3; then the window (3 s) forgets the start: 50/3, 30/3, 0/3
    assert rates == [10.0, 15.0, 20.0, 16.7, 10.0, 0.0]

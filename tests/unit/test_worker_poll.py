"""The worker's queue poll: ids of jobs already running cost no per-job arq round trips, and
a wake-up (the API enqueued a job) ends the wait between polls."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest
from arq.connections import ArqRedis

import worker.main
from shared.config import Settings
from worker.main import LadleWorker


class _Service:
    def __init__(self) -> None:
        self.settings = Settings()
        self.wake = asyncio.Event()


def test_running_jobs_are_dropped_before_arq_checks_them() -> None:
    async def scenario() -> tuple[list[bytes], list[bytes]]:
        server = fakeredis.FakeServer()
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis(server=server).connection_pool)
        worker = LadleWorker(_Service(), Settings(), pool)  # type: ignore[arg-type]
        ours = asyncio.get_running_loop().create_future()  # a job running here
        finished = asyncio.get_running_loop().create_future()
        finished.set_result(None)  # a job that ended here (arq may list it once more)
        worker.tasks = {"here": ours, "ended": finished}  # type: ignore[dict-item]
        await pool.set("arq:in-progress:elsewhere", b"1")  # running on another worker
        ids = [b"here", b"elsewhere", b"new", b"ended"]
        kept = await worker._not_running(ids)
        none_left = await worker._not_running([b"here"])  # no Redis call needed
        ours.cancel()
        return kept, none_left

    kept, none_left = asyncio.run(scenario())
    assert kept == [b"new", b"ended"]
    assert none_left == []


def test_a_wake_up_ends_the_wait_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.main, "POLL_S", 60.0)  # without a wake-up: a minute

    async def scenario() -> None:
        server = fakeredis.FakeServer()
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis(server=server).connection_pool)
        service = _Service()
        worker = LadleWorker(service, Settings(), pool)  # type: ignore[arg-type]
        polling = asyncio.create_task(worker._poll_iteration())
        await asyncio.sleep(0.1)
        assert not polling.done()  # polled the (empty) queue, now waiting
        service.wake.set()
        await asyncio.wait_for(polling, 5.0)
        assert not service.wake.is_set()  # cleared for the next wait

    asyncio.run(scenario())

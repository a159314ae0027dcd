"""The worker's queue poll: ids of jobs already running cost no per-job arq round trips, and
a wake-up (the API enqueued a job) ends the wait between polls."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import arq.worker
import fakeredis
import pytest
from arq.connections import ArqRedis
from redis.exceptions import ConnectionError as RedisConnectionError

import worker.arq_adapter
from shared.config import Settings
from worker.arq_adapter import LadleWorker


class _Service:
    def __init__(self) -> None:
        self.settings = Settings()
        self.wake = asyncio.Event()
        self.worker_id = "w1"


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


def test_jobs_held_for_another_worker_are_left_to_it_until_the_hold_ends() -> None:
    async def scenario() -> list[bytes]:
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis().connection_pool)
        worker = LadleWorker(_Service(), Settings(), pool)  # type: ignore[arg-type]
        await pool.set(worker.keys.routed("for-me"), "w1", px=60_000)
        await pool.set(worker.keys.routed("for-w2"), "w2", px=60_000)
        await pool.set(worker.keys.routed("hold-over"), "w2", px=1)
        await asyncio.sleep(0.01)
        return await worker._not_running([b"for-me", b"for-w2", b"hold-over", b"anyone"])

    assert asyncio.run(scenario()) == [b"for-me", b"hold-over", b"anyone"]


def test_a_wake_up_ends_the_wait_between_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker.arq_adapter, "POLL_S", 60.0)  # without a wake-up: a minute
    monkeypatch.setattr(worker.arq_adapter, "IDLE_POLL_S", 60.0)

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


@pytest.mark.parametrize("waiting", ["none", "held", "no room"])
def test_a_poll_that_leaves_a_job_it_may_take_looks_again_soon(
    monkeypatch: pytest.MonkeyPatch, waiting: str
) -> None:
    """Holds end and room frees without a wake-up: such a poll waits POLL_S. One that left
    nothing to wait for waits IDLE_POLL_S (here a minute) unless a wake-up comes."""
    monkeypatch.setattr(worker.arq_adapter, "POLL_S", 0.01)
    monkeypatch.setattr(worker.arq_adapter, "IDLE_POLL_S", 60.0)

    async def scenario() -> bool:
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis().connection_pool)
        service = _Service()
        poller = LadleWorker(service, Settings(), pool)  # type: ignore[arg-type]
        poller.admission_capacity = lambda: 0  # type: ignore[method-assign]
        if waiting != "none":
            await pool.zadd(poller.queue_name, {"job-1": 1})
        if waiting == "held":
            await pool.set(poller.keys.routed("job-1"), "w2", px=60_000)
        polling = asyncio.create_task(poller._poll_iteration())
        done, _ = await asyncio.wait([polling], timeout=10.0 if waiting != "none" else 0.2)
        looked_again_soon = bool(done)
        service.wake.set()  # a wake-up ends the long wait too
        await asyncio.wait_for(polling, 5.0)
        return looked_again_soon and poller.look_again_soon

    assert asyncio.run(scenario()) is (waiting != "none")


def test_a_job_handed_back_wakes_the_workers() -> None:
    """Left in the queue to run now, it must not wait for the other workers' idle poll."""

    async def scenario() -> list[bytes]:
        redis = fakeredis.FakeAsyncRedis()
        pool = ArqRedis(connection_pool=redis.connection_pool)
        poller = LadleWorker(_Service(), Settings(), pool)  # type: ignore[arg-type]
        pubsub = redis.pubsub()
        await pubsub.subscribe(poller.keys.wake_channel)
        await pubsub.get_message(timeout=1.0)  # the subscription's confirmation
        await poller.finish_job("done", True, b"r", None, False, None, None)  # finished
        await poller.finish_job("later", False, None, None, False, 1000, None)  # deferred
        await poller.finish_job("back", False, None, None, False, None, None)  # handed back
        woken = []
        while message := await pubsub.get_message(timeout=1.0):
            woken.append(message["data"])
        await pubsub.aclose()
        return woken

    assert asyncio.run(scenario()) == [b"back"]


def _jobs(lane: str, count: int, start: int = 0) -> dict[str, SimpleNamespace]:
    return {
        f"{lane}{i}": SimpleNamespace(payload=SimpleNamespace(lane=lane))
        for i in range(start, start + count)
    }


def test_batch_lines_take_only_spare_room() -> None:
    from worker.arq_adapter import admission_capacity
    from worker.service import WorkerService

    settings = Settings(
        max_batch_size=8, worker_max_queued=2, batch_reserved_seqs=3, batch_max_seqs=2
    )
    service = WorkerService.__new__(WorkerService)  # admission reads the thread's snapshot only
    snapshot = SimpleNamespace(num_waiting=0)
    service.engine_thread = SimpleNamespace(stats=snapshot)
    service.settings, service.draining = settings, False
    service.jobs, service.num_pending = _jobs("interactive", 2), 0
    service.watchdog = SimpleNamespace(is_stalled=False)  # the engine steps
    service.engine = None  # a generator
    assert admission_capacity(service, "interactive", 0) == 2  # worker_max_queued
    assert admission_capacity(service, "batch", 0) == 2  # batch_max_seqs
    assert admission_capacity(service, "batch", 1) == 1  # ... less one being started
    service.jobs.update(_jobs("batch", 1))
    assert admission_capacity(service, "batch", 0) == 1
    service.jobs.update(_jobs("interactive", 2, start=2))
    assert admission_capacity(service, "batch", 0) == 0  # only the reserved slots are left
    assert admission_capacity(service, "interactive", 0) == 2
    service.jobs = {}
    snapshot.num_waiting = 1  # anything waiting for the engine: no batch line
    assert admission_capacity(service, "batch", 0) == 0
    assert admission_capacity(service, "interactive", 0) == 1


def test_an_embedding_worker_takes_a_whole_step_of_jobs() -> None:
    from worker.arq_adapter import admission_capacity
    from worker.engine.embedding import EmbeddingEngine
    from worker.service import WorkerService

    settings = Settings(
        max_batch_size=8, worker_max_queued=2, batch_reserved_seqs=3, batch_max_seqs=2
    )
    service = WorkerService.__new__(WorkerService)
    service.engine = EmbeddingEngine.__new__(EmbeddingEngine)  # jobs end in their step
    service.engine_thread = SimpleNamespace(stats=SimpleNamespace(num_waiting=4))
    service.settings, service.draining, service.num_pending = settings, False, 0
    service.watchdog = SimpleNamespace(is_stalled=False)
    service.jobs = _jobs("batch", 4)  # waiting in the engine does not stop more lines
    assert admission_capacity(service, "batch", 0) == 1  # 8 - 3 reserved - 4
    assert admission_capacity(service, "batch", 1) == 0
    assert admission_capacity(service, "interactive", 0) == 6  # 8 + 2 - 4
    service.jobs.update(_jobs("interactive", 6))
    assert admission_capacity(service, "interactive", 0) == 0
    assert admission_capacity(service, "batch", 0) == 0


def test_each_lane_polls_its_models_own_queue() -> None:
    async def scenario() -> list[str]:
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis().connection_pool)
        settings = Settings(key_prefix="p", served_model_name="m")
        return [
            LadleWorker(_Service(), settings, pool, lane).queue_name  # type: ignore[arg-type]
            for lane in ("interactive", "batch")
        ]

    assert asyncio.run(scenario()) == ["p:queue:m", "p:queue:m:batch"]


def test_a_redis_error_at_start_up_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """arq reads Redis's INFO before its poll loop; one failure there must not end the worker."""
    monkeypatch.setattr(worker.arq_adapter, "POLL_S", 0.01)
    calls: list[int] = []

    async def flaky_info(redis: object, log_func: object) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RedisConnectionError("Timeout connecting to server")

    monkeypatch.setattr(arq.worker, "log_redis_info", flaky_info)

    async def scenario() -> None:
        server = fakeredis.FakeServer()
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis(server=server).connection_pool)
        worker = LadleWorker(_Service(), Settings(), pool)  # type: ignore[arg-type]
        worker.burst = True  # main returns once the (empty) queue has been polled
        await asyncio.wait_for(worker.main(), 30.0)

    asyncio.run(scenario())
    assert len(calls) == 2


def test_a_worker_polls_only_the_lanes_it_is_given() -> None:
    async def scenario() -> dict[str, list[str]]:
        pool = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis().connection_pool)
        queues = {}
        for lanes in ("interactive,batch", "batch"):
            settings = Settings(_env_file=None, worker_lanes=lanes, served_model_name="m")
            workers = worker.arq_adapter.lane_workers(_Service(), settings, pool)  # type: ignore[arg-type]
            queues[lanes] = [w.queue_name for w in workers]
        return queues

    queues = asyncio.run(scenario())
    assert queues == {
        "interactive,batch": ["ladle:queue:m", "ladle:queue:m:batch"],
        "batch": ["ladle:queue:m:batch"],  # a batch-only group (deploy/k8s) scales to zero
    }
    with pytest.raises(ValueError, match="worker_lanes"):
        Settings(_env_file=None, worker_lanes="interactive,bulk")

"""The API's view of live workers: cached for a moment, except an empty one."""

from __future__ import annotations

import asyncio
import time

import fakeredis

from api.jobs.workers import WorkerDirectory
from shared.keys import Keys
from tests.support.records import worker_record


async def _register(redis: fakeredis.FakeAsyncRedis, keys: Keys, worker_id: str) -> None:
    record = worker_record(worker_id)
    await redis.set(keys.worker(worker_id), record.model_dump_json())
    await redis.zadd(keys.workers, {worker_id: time.time()})


def test_the_first_worker_counts_at_once_later_ones_after_the_cache() -> None:
    async def scenario() -> None:
        redis, keys = fakeredis.FakeAsyncRedis(), Keys("t")
        directory = WorkerDirectory(redis, keys, ttl_s=5.0, cache_s=60.0)
        assert await directory.models() == {}
        await _register(redis, keys, "w1")
        assert await directory.models() == {"m": 64}  # an empty answer was not cached
        await _register(redis, keys, "w2")
        assert [r.worker_id for r in await directory.live()] == ["w1"]  # a full one is

    asyncio.run(scenario())

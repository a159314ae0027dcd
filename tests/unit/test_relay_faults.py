"""The relay ends waits on faults: API shutdown, a long Redis outage, a job Redis lost."""

from __future__ import annotations

import asyncio

import fakeredis
from redis.exceptions import ConnectionError as RedisConnectionError

from api.jobs.relay import Relay
from shared.keys import Keys

KEYS = Keys("t")


class FlakyRedis(fakeredis.FakeAsyncRedis):
    """fakeredis whose XREAD fails while `down` is set, as a stopped Redis would."""

    down = False

    async def xread(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        if self.down:
            raise RedisConnectionError("Connection refused")
        return await super().xread(*args, **kwargs)


async def test_shutdown_ends_open_waits_after_the_grace() -> None:
    relay = Relay(fakeredis.FakeAsyncRedis(), KEYS, block_ms=10)
    relay.start()
    sub = relay.subscribe("job-1")
    relay.begin_shutdown(0.05)
    assert relay.closing
    _, event = await sub.next(2)
    assert event.type == "error" and event.status == 503
    assert event.code == "server_shutting_down" and "job-1" in event.message
    late = relay.subscribe("job-2")  # after the grace: ended at once
    assert (await late.next(1))[1].code == "server_shutting_down"
    await relay.stop()


async def test_a_long_outage_ends_waits_with_503() -> None:
    redis = FlakyRedis()
    redis.down = True
    relay = Relay(redis, KEYS, block_ms=10, outage_grace_s=0.2)
    sub = relay.subscribe("job-1")
    _, event = await sub.next(3)
    assert event.code == "redis_unavailable" and event.status == 503
    assert not relay.healthy
    await relay.stop()


async def test_after_reconnecting_a_job_without_a_record_is_lost() -> None:
    redis = FlakyRedis()
    await redis.set(KEYS.job("job-kept"), "{}")
    relay = Relay(redis, KEYS, block_ms=10, verify_delay_s=0.05)
    kept, lost = relay.subscribe("job-kept"), relay.subscribe("job-gone")
    redis.down = True
    await asyncio.sleep(0.1)
    redis.down = False
    _, event = await lost.next(3)
    assert event.code == "job_lost" and event.status == 503 and "job-gone" in event.message
    assert kept.queue.empty() and relay.healthy
    await relay.stop()

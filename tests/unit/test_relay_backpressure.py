"""A reader that falls behind is paused: the relay holds at most `max_buffered` of its events,
stops reading its stream (no busy loop), and delivers every entry, in order, once it catches
up; a second reader of the same stream is not held back."""

from __future__ import annotations

import asyncio

import fakeredis

from api.jobs.relay import Relay
from shared.contracts import DeltaEvent, encode_event
from shared.keys import Keys

KEYS = Keys("t")
NUM_EVENTS, BOUND = 100, 8


class CountingRedis(fakeredis.FakeAsyncRedis):
    num_reads = 0

    async def xread(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.num_reads += 1
        return await super().xread(*args, **kwargs)


async def _fill(redis: CountingRedis) -> list[str]:
    ids = []
    for i in range(NUM_EVENTS):
        event = DeltaEvent(index=0, text=f"t{i} ", token_ids=[i])
        ids.append((await redis.xadd(KEYS.stream("job-1"), {"data": encode_event(event)})).decode())
    return ids


async def _until(check, timeout: float = 5.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def test_a_slow_reader_is_bounded_paused_and_gets_everything() -> None:
    redis = CountingRedis()
    ids = await _fill(redis)
    relay = Relay(redis, KEYS, block_ms=10, max_buffered=BOUND)
    slow, fast = relay.subscribe("job-1"), relay.subscribe("job-1")
    fast_got = [(await fast.next(5))[0] for _ in range(NUM_EVENTS)]
    assert fast_got == ids  # the fast reader is not held back by the slow one
    relay.unsubscribe(fast)
    await _until(lambda: slow.is_paused and relay.num_paused == 1)
    assert slow.queue.qsize() == BOUND and relay.num_buffered == BOUND
    reads = redis.num_reads
    await asyncio.sleep(0.3)
    assert redis.num_reads - reads <= 1  # paused: its stream is not read in a loop
    got = [(await slow.next(5))[0] for _ in range(NUM_EVENTS)]
    assert got == ids and not slow.is_paused
    await relay.stop()

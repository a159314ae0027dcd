"""A subscriber that arrives while the relay's read blocks on other streams gets its events
without waiting out that block: its stream gets a read of its own."""

from __future__ import annotations

import asyncio

import fakeredis
import pytest

from api.jobs.relay import Relay
from shared.contracts import DeltaEvent, ErrorEvent, encode_event
from shared.keys import Keys

KEYS = Keys("t")
LONG_BLOCK_MS = 60_000  # far past the test's deadline: only a read of its own can answer
EVENT = DeltaEvent(index=0, text="x", token_ids=[1])


async def _read_in_flight(relay: Relay, streams: set[str]) -> None:
    async with asyncio.timeout(10):
        while not any(s == streams for s in relay._reads[0].values()):
            await asyncio.sleep(0.01)


async def test_a_new_stream_is_read_while_another_read_blocks() -> None:
    redis = fakeredis.FakeAsyncRedis()
    relay = Relay(redis, KEYS, block_ms=LONG_BLOCK_MS)
    idle = relay.subscribe("job-idle")
    await _read_in_flight(relay, {KEYS.stream("job-idle")})
    fresh = relay.subscribe("job-fresh")
    entry_id = await redis.xadd(KEYS.stream("job-fresh"), {"data": encode_event(EVENT)})
    got_id, event = await fresh.next(timeout=10)
    assert got_id == entry_id.decode() and event == EVENT
    assert fresh.queue.empty() and idle.queue.empty()
    await relay.stop()


async def test_an_entry_read_by_two_reads_is_delivered_once() -> None:
    redis = fakeredis.FakeAsyncRedis()
    relay = Relay(redis, KEYS, block_ms=LONG_BLOCK_MS)
    first = relay.subscribe("job-1")
    await _read_in_flight(relay, {KEYS.stream("job-1")})
    second = relay.subscribe("job-1")  # covered already: no second read for it
    assert len(relay._reads[0]) == 1
    ids = [await redis.xadd(KEYS.stream("job-1"), {"data": encode_event(EVENT)})]
    for sub in (first, second):
        assert (await sub.next(timeout=10))[0] == ids[0].decode()
    relay._deliver([(KEYS.stream("job-1").encode(), [(ids[0], {b"data": b"{}"})])])
    assert first.queue.empty() and second.queue.empty()
    await relay.stop()


async def test_a_stream_is_not_read_again_after_its_last_event() -> None:
    redis = fakeredis.FakeAsyncRedis()
    relay = Relay(redis, KEYS, block_ms=LONG_BLOCK_MS)
    sub = relay.subscribe("job-1")
    last = ErrorEvent(status=500, error_type="server_error", message="failed")
    for event in (EVENT, last):
        await redis.xadd(KEYS.stream("job-1"), {"data": encode_event(event)})
    assert [(await sub.next(timeout=10))[1] for _ in range(2)] == [EVENT, last]
    async with asyncio.timeout(10):  # the read that brought them ends; no other begins
        while relay._reads[0]:
            await asyncio.sleep(0.01)
    assert sub.is_ended and relay._positions(0) == {}
    await relay.stop()


async def test_next_waits_at_most_its_timeout_and_takes_a_waiting_event_at_once() -> None:
    relay = Relay(fakeredis.FakeAsyncRedis(), KEYS, block_ms=LONG_BLOCK_MS)
    sub = relay.subscribe("job-1")
    with pytest.raises(TimeoutError):
        await sub.next(timeout=0.05)
    sub.queue.put_nowait(("1-0", EVENT))
    assert await sub.next(timeout=0) == ("1-0", EVENT)
    await relay.stop()

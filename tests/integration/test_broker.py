"""The brokers `ladle up` can start: a private redis-server and the embedded fakeredis server."""

from __future__ import annotations

import asyncio
import importlib.util
import os

import pytest
import redis

from ladle import broker
from shared.queue import deserialize_job, serialize_job

# The worker's final-state write in miniature: compare-and-set, then append to a stream.
CAS_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current == 'final' then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', 100, '*', 'data', ARGV[1])
return 1
"""

needs_redis_server = pytest.mark.skipif(
    broker.redis_server_binary() is None, reason="no redis-server binary on PATH"
)
needs_lupa = pytest.mark.skipif(
    importlib.util.find_spec("lupa") is None,
    reason="lupa is not installed: fakeredis cannot run Lua scripts (pip install lupa)",
)


@needs_redis_server
def test_private_redis_server_starts_and_stops() -> None:
    handle = broker.start_private_redis(broker.redis_server_binary())
    try:
        assert handle.kind == "private-redis-server"
        assert handle.url.startswith("redis://127.0.0.1:")
        client = redis.Redis.from_url(handle.url)
        assert client.config_get("appendonly") == {"appendonly": "no"}
        assert client.config_get("save") == {"save": ""}
        data_dir = client.config_get("dir")["dir"]
        assert os.path.isdir(data_dir)
        client.close()
        assert broker.lua_works(handle.url)
    finally:
        handle.stop()
    assert not broker.ping(handle.url, timeout_s=0.5)
    assert not os.path.exists(data_dir)


def test_find_prefers_a_configured_redis_that_answers() -> None:
    running = broker.start_embedded_broker() if _has_lupa() else None
    if running is None:
        pytest.skip("lupa is not installed: the embedded broker refuses to start without it")
    try:
        handle = broker.find_or_start_redis(running.url)
        assert (handle.url, handle.kind) == (running.url, "configured")
        handle.stop()  # a configured Redis is not ours to stop
        assert broker.ping(running.url)
    finally:
        running.stop()


def test_find_starts_one_when_nothing_answers() -> None:
    dead = f"redis://127.0.0.1:{broker.spare_port()}/0"
    if broker.redis_server_binary() is None and not _has_lupa():
        pytest.skip("neither redis-server nor lupa (for the embedded broker) is installed")
    handle = broker.find_or_start_redis(dead)
    try:
        expected = "private-redis-server" if broker.redis_server_binary() else "embedded"
        assert handle.kind == expected
        assert broker.ping(handle.url)
    finally:
        handle.stop()


@pytest.fixture
def embedded() -> broker.BrokerHandle:
    handle = broker.start_embedded_broker()
    yield handle
    handle.stop()


@needs_lupa
def test_embedded_ping_streams_and_lua(embedded: broker.BrokerHandle) -> None:
    assert embedded.kind == "embedded"
    client = redis.Redis.from_url(embedded.url)
    other = redis.Redis.from_url(embedded.url)  # a second connection sees the same data
    assert client.ping() is True
    first = client.xadd("s", {"data": "a"})
    second = client.xadd("s", {"data": "b"})
    entries = [(first, {b"data": b"a"}), (second, {b"data": b"b"})]
    assert other.xread({"s": "0"}) == [[b"s", entries]]
    assert other.xread({"s": first}) == [[b"s", [(second, {b"data": b"b"})]]]
    finish = client.register_script(CAS_SCRIPT)  # EVALSHA, falling back to EVAL
    assert finish(keys=["job", "events"], args=["final"]) == 1
    assert finish(keys=["job", "events"], args=["late"]) == 0
    assert other.get("job") == b"final"
    assert other.xlen("events") == 1
    assert client.eval("return ARGV[1] .. KEYS[1]", 1, "k", "v") == b"vk"
    client.close()
    other.close()


@needs_lupa
def test_embedded_runs_an_arq_job(embedded: broker.BrokerHandle) -> None:
    """arq's worker (INFO at start, zsets, pipelines, WATCH) works against the embedded broker."""
    from arq.connections import RedisSettings, create_pool
    from arq.worker import Worker, func

    async def add(ctx: dict, a: int, b: int) -> int:
        return a + b

    async def run() -> int:
        codec = {"job_serializer": serialize_job, "job_deserializer": deserialize_job}
        pool = await create_pool(RedisSettings.from_dsn(embedded.url), **codec)
        job = await pool.enqueue_job("add", 2, 3, _job_id="j1")
        worker = Worker(
            functions=[func(add, name="add")],
            redis_pool=pool,
            burst=True,
            poll_delay=0.02,
            handle_signals=False,
            **codec,
        )
        await worker.main()
        result = await job.result(timeout=5)
        await worker.close()
        return result

    assert asyncio.run(run()) == 5


def _has_lupa() -> bool:
    return importlib.util.find_spec("lupa") is not None

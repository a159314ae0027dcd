"""Ladle's Redis clients on real Sentinel and Cluster topologies (redis-server processes)."""

from __future__ import annotations

import asyncio
import time

import pytest
from arq.connections import create_pool
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from api.app import make_redis
from api.jobs.reconcile import PrimaryWatch
from shared.config import Settings
from shared.keys import Keys
from shared.redis_url import arq_redis_settings, sync_client
from shared.relay_shards import CLUSTER_STREAM_GROUPS, StreamShards
from shared.replication import NotReplicated, ReplicaWaiter
from tests.support.harness import wait_until
from tests.support.redis_topology import REDIS_SERVER, Node, redis_cluster, sentinel_group

pytestmark = pytest.mark.skipif(
    not REDIS_SERVER.startswith("/"), reason="needs redis-server and redis-cli on PATH"
)


async def _until_written(write: object, timeout_s: float = 30.0) -> float:
    """Retry an async write through the failover; seconds until it went through."""
    started = time.monotonic()
    while True:
        try:
            await write()  # type: ignore[operator]
            return time.monotonic() - started
        except (RedisError, OSError):
            assert time.monotonic() - started < timeout_s, "no primary after the failover"
            await asyncio.sleep(0.05)


async def test_every_client_follows_a_sentinel_failover() -> None:
    with sentinel_group() as group:
        settings = Settings(redis_url=group.url, _env_file=None)
        api = make_redis(settings, Keys("topo"))
        worker = await create_pool(arq_redis_settings(group.url))
        launcher = sync_client(group.url, socket_timeout=1)
        await api.set("before", "1")
        assert await api.wait(1, 5000) == 1  # the replica has it before the primary dies
        await _replica_waits_are_checked(api, group)
        watch = PrimaryWatch(api)
        assert not await watch.changed()
        old_port = group.primary_port()

        failover_s = group.kill_primary()

        assert group.primary_port() not in (None, old_port)
        await _until_written(lambda: api.set("after-api", "1"))
        await _until_written(lambda: worker.set("after-worker", "1"))
        wait_until(lambda: _sync_set(launcher), 30, "the sync client to write")
        new_primary = group.current_primary().client()
        assert new_primary.mget("before", "after-api", "after-worker", "after-sync") == [b"1"] * 4
        assert await watch.changed()  # the API reconciles its queued jobs after this
        assert await ReplicaWaiter(api).num_required() == 0  # its replica died with it
        assert failover_s < 20
        await api.aclose()
        await worker.aclose()
        launcher.close()


async def _replica_waits_are_checked(api: object, group: object) -> None:
    """WAIT covers a pipeline's writes while the replica answers, and a stopped replica makes
    the check fail instead of passing silently."""
    waiter = ReplicaWaiter(api, timeout_ms=300)  # type: ignore[arg-type]
    num_required = await waiter.num_required()
    assert num_required == 1
    for replica_stopped in (False, True):
        if replica_stopped:
            group.replica.pause()  # type: ignore[attr-defined]
        pipe = api.pipeline(transaction=False)  # type: ignore[attr-defined]
        pipe.set("waited", "1")
        waiter.add_wait(pipe, num_required)
        results = await pipe.execute()
        if replica_stopped:
            with pytest.raises(NotReplicated):
                waiter.check(results, num_required)
        else:
            waiter.check(results, num_required)
    group.replica.pause(False)  # type: ignore[attr-defined]
    group.wait_in_sync()  # type: ignore[attr-defined]


def _sync_set(client: object) -> bool:
    try:
        return bool(client.set("after-sync", "1"))  # type: ignore[attr-defined]
    except (RedisConnectionError, RedisError, OSError):
        return False


def test_hash_tagged_job_keys_spread_over_the_cluster_one_slot_per_job() -> None:
    keys = Keys("topo")
    job_ids = [f"job-{i:04d}" for i in range(60)]
    with redis_cluster(3) as cluster:
        client = cluster.client()
        for job_id in job_ids:
            slots = {
                client.keyslot(key)
                for key in (keys.job(job_id), keys.stream(job_id), keys.cancelled(job_id))
            }
            assert slots == {client.keyslot(f"{{{job_id}}}")}
            # A multi-key command over one job's keys works: they share a slot.
            client.mset({keys.job(job_id): "{}", keys.cancelled(job_id): "1"})
            client.xadd(keys.stream(job_id), {"data": "x"})
        per_master = cluster.keys_per_master(f"{keys.prefix}:stream:*")
        assert sum(per_master) == len(job_ids) and min(per_master) > 0, per_master
        client.close()


async def test_cluster_stream_reads_and_writes_follow_ask_and_moved() -> None:
    """A stream's slot migrates to another master while the relay reads it: the read first
    gets ASK (slot migrating), then MOVED (slot moved), and both arrive at the stream."""
    keys = Keys("topo", stream_groups=CLUSTER_STREAM_GROUPS)
    stream = keys.stream("job-moving")
    with redis_cluster(3) as cluster:
        shards = StreamShards(make_redis(Settings(_env_file=None), keys), [], cluster.url)
        group, slot = shards.group(stream), cluster.client().keyslot(stream)
        await shards.clients[0].xadd(stream, {"data": "1"})
        assert await _read_all(shards, group, stream) == [b"1"]  # the slot cache is filled
        source = cluster.owner(slot)
        target = next(node for node in cluster.masters if node is not source)
        cluster.start_moving(slot, target)
        assert [_keys_in(node, slot) for node in (source, target)] == [0, 1]
        assert await _read_all(shards, group, stream) == [b"1"]  # ASK, then ASKING at target
        cluster.finish_moving(slot, target)
        assert await _read_all(shards, group, stream) == [b"1"]  # MOVED: the cache is updated
        async with shards.clients[0].pipeline(transaction=False) as pipe:  # the publisher's way
            pipe.xadd(stream, {"data": "2"})
            await pipe.execute()
        assert await _read_all(shards, group, stream) == [b"1", b"2"]
        assert shards.cluster.get_node_from_key(stream).port == target.port  # type: ignore[union-attr]
        assert cluster.owner(slot) is target
        await shards.aclose()
        await shards.main.aclose()


async def _read_all(shards: StreamShards, group: int, stream: str) -> list[bytes]:
    replies = await shards.read(group, {stream: "0-0"}, block_ms=100)
    return [fields[b"data"] for _, entries in replies for _, fields in entries]


def _keys_in(node: Node, slot: int) -> int:
    return node.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)

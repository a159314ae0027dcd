"""Where a job's token stream lives: on the main Redis, on N relay Redis instances, or in a
Redis Cluster.

Every token is one stream entry written by a worker and one read by an API process's relay, so
one Redis core bounds the fleet's token rate (docs/benchmarks.md, "The token relay"). With
`LLM_RELAY_REDIS_URLS` set, each job's stream goes to the instance its hash-tagged key picks:
the key's Redis Cluster slot (of the job id in braces), the 16384 slots split evenly over the
instances, so every process agrees without asking anyone. With `LLM_RELAY_REDIS_CLUSTER_URL`
the streams live in a Redis Cluster, each tagged by one of `CLUSTER_STREAM_GROUPS` slot groups
(shared/keys.py), and redis-py's cluster client follows MOVED and ASK. Job records, payloads,
cancel markers and arq's queues stay on the main Redis; so does everything when both are unset.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from shared.config import Settings
from shared.keys import Keys
from shared.redis_url import async_pool

# Stream slot groups in a cluster: a relay process runs one XREAD per group; 24 splits evenly
# over 1, 2, 3, 4, 6, 8, 12 or 24 masters.
CLUSTER_STREAM_GROUPS = 24
StreamClient = Redis | RedisCluster


def shard_of(key: str, num_shards: int) -> int:
    """The shard of a (hash-tagged) key: its cluster slot's share of the slot range."""
    return key_slot(key.encode()) * num_shards // REDIS_CLUSTER_HASH_SLOTS


def keys_for(settings: Settings) -> Keys:
    """The key names; stream keys depend on whether the streams are in a cluster."""
    groups = CLUSTER_STREAM_GROUPS if settings.relay_redis_cluster_url else 0
    return Keys(settings.key_prefix, stream_groups=groups)


def stream_shards(main: Redis, settings: Settings, **pool_kwargs: Any) -> StreamShards:
    return StreamShards(
        main, settings.relay_redis_urls, settings.relay_redis_cluster_url, **pool_kwargs
    )


class StreamShards:
    """The Redis clients that hold job streams, which one holds a given stream, and the groups
    of streams that one XREAD can read together (a client's streams, or a cluster slot group)."""

    def __init__(
        self, main: Redis, urls: list[str], cluster_url: str | None = None, **pool_kwargs: Any
    ) -> None:
        self.main = main
        self._shards = [Redis(connection_pool=async_pool(url, **pool_kwargs)) for url in urls]
        self.cluster = RedisCluster.from_url(cluster_url, **pool_kwargs) if cluster_url else None

    @property
    def is_sharded(self) -> bool:
        """Streams are not on the main Redis."""
        return bool(self._shards) or self.cluster is not None

    @property
    def clients(self) -> list[StreamClient]:
        if self.cluster is not None:
            return [self.cluster]
        return self._shards or [self.main]  # type: ignore[return-value]

    def index(self, stream_key: str) -> int:
        return shard_of(stream_key, len(self._shards)) if self._shards else 0

    def for_stream(self, stream_key: str) -> StreamClient:
        return self.clients[self.index(stream_key)]

    @property
    def num_groups(self) -> int:
        return CLUSTER_STREAM_GROUPS if self.cluster is not None else len(self.clients)

    def group(self, stream_key: str) -> int:
        if self.cluster is not None:
            return shard_of(stream_key, CLUSTER_STREAM_GROUPS)
        return self.index(stream_key)

    async def read(self, group: int, positions: dict[str, str], block_ms: int) -> list:
        """XREAD BLOCK over streams of one group. In a cluster it goes to the node the slot
        cache names (redis-py would ask a node for XREAD's keys first, a round trip per read);
        a MOVED or ASK reply is followed and updates that cache."""
        if self.cluster is None:
            return await self.clients[group].xread(positions, block=block_ms)
        await self.cluster.initialize()  # no-op unless new or reset after a connection error
        node = self.cluster.get_node_from_key(next(iter(positions)))
        streams = [*positions.keys(), *positions.values()]
        return await self.cluster.execute_command(
            "XREAD", "BLOCK", block_ms, "STREAMS", *streams, target_nodes=node
        )

    async def aclose(self) -> None:
        for client in self._shards:
            await client.aclose()
        if self.cluster is not None:
            await self.cluster.aclose()

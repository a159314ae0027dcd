"""Where a job's token stream lives: on the main Redis, or spread over N relay Redis instances.

Every token is one stream entry written by a worker and one read by an API process's relay, so
one Redis core bounds the fleet's token rate (docs/benchmarks.md, "The token relay"). With
`LLM_RELAY_REDIS_URLS` set, each job's stream goes to the instance its hash-tagged key picks:
the key's Redis Cluster slot (of the job id in braces), the 16384 slots split evenly over the
instances, so every process agrees without asking anyone. Job records, payloads, cancel
markers and arq's queues stay on the main Redis; so does everything when the setting is unset.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from shared.redis_url import async_pool


def shard_of(key: str, num_shards: int) -> int:
    """The shard of a (hash-tagged) key: its cluster slot's share of the slot range."""
    return key_slot(key.encode()) * num_shards // REDIS_CLUSTER_HASH_SLOTS


class StreamShards:
    """The Redis clients that hold job streams, and which one holds a given stream."""

    def __init__(self, main: Redis, urls: list[str], **pool_kwargs: Any) -> None:
        self.main = main
        self._shards = [Redis(connection_pool=async_pool(url, **pool_kwargs)) for url in urls]

    @property
    def is_sharded(self) -> bool:
        return bool(self._shards)

    @property
    def clients(self) -> list[Redis]:
        return self._shards or [self.main]

    def index(self, stream_key: str) -> int:
        return shard_of(stream_key, len(self._shards)) if self._shards else 0

    def for_stream(self, stream_key: str) -> Redis:
        return self.clients[self.index(stream_key)]

    async def aclose(self) -> None:
        for client in self._shards:
            await client.aclose()

"""The worker's prefix fingerprint: what its prefix cache holds, for the API's router.

Written with every heartbeat, and again as a job completes, before its final write: the
client's next turn arrives right after the answer, and must find the blocks that answer left.
"""

from __future__ import annotations

from collections.abc import Callable

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from shared.contracts import PrefixFingerprint
from shared.keys import Keys
from shared.prefixes import PrefixFilter, filter_bits_for
from worker.engine.engine import EngineStats


class PrefixPublisher:
    """Builds the Bloom filter of the engine's cached block hashes (again only when they
    changed) and writes it, with the worker's room for jobs, under `Keys.prefixes`."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        worker_id: str,
        model: str,
        ttl_s: float,
        stats: Callable[[], EngineStats],
        room: Callable[[], int],
    ) -> None:
        self.redis = redis
        self.key = keys.prefixes(worker_id)
        self.worker_id = worker_id
        self.model = model
        self.ttl_ms = int(ttl_s * 1000)
        self._stats = stats
        self._room = room
        self._hashes: tuple[bytes, ...] | None = None
        self._filter: PrefixFilter | None = None

    def fingerprint(self) -> PrefixFingerprint:
        stats = self._stats()
        hashes = stats.cached_block_hashes
        if hashes is not self._hashes or self._filter is None:
            self._filter = PrefixFilter.of(hashes, filter_bits_for(stats.num_blocks_total))
            self._hashes = hashes
        return PrefixFingerprint(
            worker_id=self.worker_id,
            model=self.model,
            block_size=stats.block_size,
            num_bits=self._filter.num_bits,
            filter=self._filter.encode(),
            num_blocks=len(hashes),
            room=self._room(),
            running=stats.num_running,
            waiting=stats.num_waiting,
        )

    def write(self, pipe: Pipeline) -> None:
        """Queue the write on a pipeline (the heartbeat's)."""
        pipe.set(self.key, self.fingerprint().model_dump_json(), px=self.ttl_ms)

    async def publish(self) -> None:
        await self.redis.set(self.key, self.fingerprint().model_dump_json(), px=self.ttl_ms)

    async def remove(self) -> None:
        await self.redis.delete(self.key)

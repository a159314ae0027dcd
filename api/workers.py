"""Live workers, read from the heartbeat zset and records (stale ones pruned)."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from api.errors import APIError, model_not_found
from shared.contracts import ChildStatus, SupervisorRecord, WorkerRecord
from shared.keys import Keys


class WorkerDirectory:
    """Who is alive and what they serve, cached for a fraction of a second."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: float, cache_s: float = 0.5) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.cache_s = cache_s
        self._cached: tuple[float, list[WorkerRecord]] | None = None

    async def live(self) -> list[WorkerRecord]:
        now = time.time()
        if self._cached and now - self._cached[0] < self.cache_s:
            return self._cached[1]
        await self.redis.zremrangebyscore(self.keys.workers, "-inf", now - self.ttl_s)
        ids = [_text(i) for i in await self.redis.zrange(self.keys.workers, 0, -1)]
        raws = await self.redis.mget([self.keys.worker(i) for i in ids]) if ids else []
        records = [WorkerRecord.model_validate_json(raw) for raw in raws if raw]
        self._cached = (now, records)
        return records

    async def models(self) -> dict[str, int]:
        """Served model name -> the smallest max_model_len among its live workers."""
        served: dict[str, int] = {}
        for record in await self.live():
            if record.status == "draining":
                continue
            served[record.model] = min(
                served.get(record.model, record.max_model_len), record.max_model_len
            )
        return served

    async def resolve(self, requested: str | None, default: str) -> tuple[str, int]:
        """(model name, max_model_len) for a request; 503 without workers, 404 if unknown."""
        served = await self.models()
        if not served:
            raise APIError(
                503,
                "No worker is serving any model right now; try again later",
                code="no_workers",
                headers={"Retry-After": "5"},
            )
        name = requested or (default if default in served else next(iter(served)))
        if name not in served:
            raise model_not_found(name)
        return name, served[name]


async def supervised_children(redis: Redis, keys: Keys) -> list[ChildStatus]:
    """The processes live `ladle up` supervisors run (none without `ladle up`)."""
    await redis.zremrangebyscore(keys.supervisors, "-inf", time.time() - 10.0)
    ids = [_text(i) for i in await redis.zrange(keys.supervisors, 0, -1)]
    raws = await redis.mget([keys.supervisor(i) for i in ids]) if ids else []
    records = [SupervisorRecord.model_validate_json(raw) for raw in raws if raw]
    return [child for record in records for child in record.children]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

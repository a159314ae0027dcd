"""Live workers, read from the heartbeat zset and records (stale ones pruned)."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from api.errors import APIError, model_not_found
from shared.contracts import ChildStatus, ModelInfo, SupervisorRecord, WorkerRecord
from shared.keys import Keys

# Live workers that take no new jobs: shutting down, or their engine is stuck.
NOT_SERVING = frozenset({"draining", "unhealthy"})


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
        # none yet is read again next time: the first worker's first heartbeat counts at once
        self._cached = (now, records) if records else None
        return records

    async def models(self) -> dict[str, int]:
        """Served model name -> the smallest max_model_len among its live workers."""
        served: dict[str, int] = {}
        for record in await self.live():
            if record.status in NOT_SERVING:
                continue
            served[record.model] = min(
                served.get(record.model, record.max_model_len), record.max_model_len
            )
        return served

    async def descriptions(self) -> dict[str, dict[str, str]]:
        """Served model name -> what its live workers say it is (architecture, precision)."""
        described: dict[str, dict[str, str]] = {}
        for record in await self.live():
            if record.status not in NOT_SERVING:
                described[record.model] = {
                    "architecture": record.architecture,
                    "weight_precision": record.weight_precision,
                }
        return described

    async def known(self) -> dict[str, ModelInfo]:
        """Models served lately (workers write them each heartbeat), live or not."""
        raw = await self.redis.hgetall(self.keys.models)
        infos = (ModelInfo.model_validate_json(value) for value in raw.values())
        return {info.name: info for info in infos}

    async def resolve(
        self, requested: str | None, default: str, *, require_live: bool = True
    ) -> ModelInfo:
        """The model a request names (or the default): 404 `model_not_found` for a model no
        worker has served lately, 503 with Retry-After for one whose workers are all gone
        (unless `require_live` is off: batch lines wait in the model's queue)."""
        live = {r.model: r for r in await self.live() if r.status not in NOT_SERVING}
        name = requested or (default if default in live or not live else min(live))
        if name in live:
            served = await self.models()
            return ModelInfo.of(live[name]).model_copy(update={"max_model_len": served[name]})
        known = await self.known()
        if name not in known and name != default:
            raise model_not_found(name)
        if require_live or name not in known:
            raise APIError(
                503,
                f"No worker is serving the model `{name}` right now; try again later",
                code="no_workers",
                headers={"Retry-After": "5"},
            )
        return known[name]

    async def source(self, name: str) -> str | None:
        """Where the model `name` loads from (a live worker's or the last known one's)."""
        for record in await self.live():
            if record.model == name and record.model_source:
                return record.model_source
        info = (await self.known()).get(name)
        return info.source if info is not None and info.source else None


async def supervised_children(redis: Redis, keys: Keys) -> list[ChildStatus]:
    """The processes live `ladle up` supervisors run (none without `ladle up`)."""
    await redis.zremrangebyscore(keys.supervisors, "-inf", time.time() - 10.0)
    ids = [_text(i) for i in await redis.zrange(keys.supervisors, 0, -1)]
    raws = await redis.mget([keys.supervisor(i) for i in ids]) if ids else []
    records = [SupervisorRecord.model_validate_json(raw) for raw in raws if raw]
    return [child for record in records for child in record.children]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

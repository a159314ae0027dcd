"""The worker's heartbeat: its record (with KV usage) and prefix fingerprint in Redis, and its
arq leases renewed."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable

from arq.constants import in_progress_key_prefix
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from shared.contracts import ModelInfo, WorkerRecord
from shared.keys import Keys
from worker.engine.engine import EngineStats
from worker.prefixes import PrefixPublisher

logger = logging.getLogger(__name__)

ARQ_IN_PROGRESS_PREFIX = in_progress_key_prefix  # arq's lease key of a running job
MODELS_TTL_S = 86_400
RATE_WINDOW_S = 3.0  # the tokens/s in the worker record is averaged over this long


class Heartbeat:
    """Every interval: SET the WorkerRecord with a TTL, ZADD the workers index, and extend
    the arq in-progress leases of this worker's jobs, so a killed worker's jobs become
    runnable elsewhere within `lease_s` rather than after the whole job timeout. After a
    Redis restart the next beat puts all of it back (and `restore` the running jobs' records).
    """

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        base: WorkerRecord,
        interval_s: float,
        ttl_s: float,
        stats: Callable[[], EngineStats],
        job_ids: Callable[[], list[str]],
        status: Callable[[], str],
        restore: Callable[[Pipeline], None] | None = None,
        generated_tokens: Callable[[], int] | None = None,
        prefixes: PrefixPublisher | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.base = base
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._stats = stats
        self._job_ids = job_ids
        self._status = status
        self._restore = restore
        self._generated_tokens = generated_tokens
        self._prefixes = prefixes
        # (monotonic time, tokens generated so far) over the last RATE_WINDOW_S
        self._samples: deque[tuple[float, int]] = deque()
        self._task: asyncio.Task[None] | None = None

    def record(self) -> WorkerRecord:
        stats = self._stats()
        return self.base.model_copy(
            update={
                "status": self._status(),
                "kv_blocks_used": stats.num_blocks_used,
                "kv_blocks_total": stats.num_blocks_total,
                "kv_bytes_per_block": stats.kv_bytes_per_block,
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "tokens_per_s": self._tokens_per_s(),
                "heartbeat_at": time.time(),
            }
        )

    def _tokens_per_s(self) -> float:
        """Generated tokens per second over the last few seconds (steadier than one beat)."""
        if self._generated_tokens is None:
            return 0.0
        now, count = time.monotonic(), self._generated_tokens()
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= RATE_WINDOW_S:
            self._samples.popleft()
        then, before = self._samples[0]
        return round((count - before) / (now - then), 1) if now > then else 0.0

    async def beat(self) -> None:
        record = self.record()
        ttl_ms = int(self.ttl_s * 1000)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(self.keys.worker(record.worker_id), record.model_dump_json(), px=ttl_ms)
            pipe.zadd(self.keys.workers, {record.worker_id: record.heartbeat_at})
            # Known models outlive their workers a day: requests get 503, not 404, meanwhile.
            pipe.hset(self.keys.models, record.model, ModelInfo.of(record).model_dump_json())
            pipe.expire(self.keys.models, MODELS_TTL_S)
            for job_id in self._job_ids():
                # SET, not PEXPIRE: a lease that ran out while Redis was away comes back.
                pipe.set(ARQ_IN_PROGRESS_PREFIX + job_id, b"1", px=ttl_ms)
            if self._restore is not None:
                self._restore(pipe)
            if self._prefixes is not None:
                self._prefixes.write(pipe)
            await pipe.execute()

    async def remove(self) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(self.keys.worker(self.base.worker_id))
            pipe.zrem(self.keys.workers, self.base.worker_id)
            pipe.delete(self.keys.prefixes(self.base.worker_id))
            await pipe.execute()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as exc:
                logger.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.interval_s)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"

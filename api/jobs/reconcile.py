"""After a Redis primary change: job records checked against arq's queue entries.

A submission writes its record, payload and arq job in one script (api/jobs/store.py), and
the API waits for a replica after it (shared/replication.py) before it answers 202. What a
failover can still leave is a record saying `queued` with no arq job behind it (a reconcile's
own requeue cut off, or an API of an older release that wrote them one after the other): it
would wait forever. This puts such a job back in its
queue from its payload, or, without a payload, ends it `failed` with `job_lost` so that its
waiting client and its pollers hear it. A job submitted in the last `min_age_s` is left alone
(its API may still be enqueueing it) and looked at again once it is old enough.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from arq.connections import ArqRedis
from arq.constants import job_key_prefix
from redis.exceptions import RedisError, WatchError

from shared.background import BackgroundTask
from shared.contracts import ErrorEvent, JobPayload, JobRecord, encode_event
from shared.keys import Keys
from shared.queue import RUN_COMPLETION
from shared.relay_shards import StreamShards

log = logging.getLogger(__name__)
MIN_AGE_S = 10.0


@dataclass
class Reconciled:
    requeued: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    # When the youngest record left alone (no arq job, but its API may be enqueueing it)
    # is old enough to judge; None when none was.
    judge_young_at: float | None = None


class PrimaryWatch:
    """Tells when the Redis behind a client is another server than the last time (its run id
    changes on a failover, and on a restart)."""

    def __init__(self, redis: ArqRedis) -> None:
        self.redis = redis
        self.run_id: str | None = None
        self.recheck_at: float | None = None  # a reconcile left records too young to judge

    async def changed(self) -> bool:
        run_id = (await self.redis.info("server")).get("run_id")
        previous, self.run_id = self.run_id, run_id
        return previous is not None and run_id != previous


async def reconcile(
    redis: ArqRedis,
    keys: Keys,
    job_ttl_s: int,
    min_age_s: float = MIN_AGE_S,
    shards: StreamShards | None = None,
) -> Reconciled:
    """Queue again, or fail, every `queued` record older than `min_age_s` without an arq job."""
    done = Reconciled()
    async for key in redis.scan_iter(match=keys.job("*"), count=500):
        raw = await redis.get(key)
        if raw is None or b'"status":"queued"' not in raw:
            continue
        record = JobRecord.model_validate_json(raw)
        if await redis.exists(job_key_prefix + record.id):
            continue
        if time.time() - record.created_at < min_age_s:
            judge_at = record.created_at + min_age_s
            done.judge_young_at = max(done.judge_young_at or judge_at, judge_at)
            continue
        await _requeue_or_fail(redis, keys, record, job_ttl_s, done, shards)
    if done.requeued or done.failed:
        log.warning("reconciled jobs after a primary change", extra=done.__dict__)
    return done


async def _requeue_or_fail(
    redis: ArqRedis,
    keys: Keys,
    record: JobRecord,
    job_ttl_s: int,
    done: Reconciled,
    shards: StreamShards | None,
) -> None:
    payload_json = await redis.get(keys.payload(record.id))
    if payload_json is not None:
        payload = JobPayload.model_validate_json(payload_json)
        await redis.enqueue_job(
            RUN_COMPLETION,
            payload.model_dump_json(),
            _job_id=record.id,
            _queue_name=keys.queue(payload.model, payload.lane),
        )
        done.requeued.append(record.id)
    elif await _fail_lost(redis, keys, record, job_ttl_s, shards or StreamShards(redis, [])):
        done.failed.append(record.id)


async def _fail_lost(
    redis: ArqRedis, keys: Keys, record: JobRecord, job_ttl_s: int, shards: StreamShards
) -> bool:
    """`failed` with `job_lost`, and the error on its stream, unless it changed meanwhile."""
    error = ErrorEvent(
        status=503,
        error_type="service_unavailable",
        code="job_lost",
        message=f"Job {record.id} was lost in a Redis failover before it was queued; "
        "submit it again",
    )
    record.status, record.error, record.finished_at = "failed", error, time.time()
    try:
        async with redis.pipeline(transaction=True) as pipe:
            await pipe.watch(keys.job(record.id))
            current = await pipe.get(keys.job(record.id))
            if current is None or json.loads(current).get("status") != "queued":
                return False
            pipe.multi()
            pipe.set(keys.job(record.id), record.model_dump_json(), ex=job_ttl_s)
            await pipe.execute()
    except WatchError:
        return False
    stream = keys.stream(record.id)
    async with shards.for_stream(stream).pipeline(transaction=False) as pipe:
        pipe.xadd(stream, {"data": encode_event(error)})
        pipe.expire(stream, job_ttl_s)
        await pipe.execute()
    return True


async def reconcile_after_failover(
    watch: PrimaryWatch,
    redis: ArqRedis,
    keys: Keys,
    job_ttl_s: int,
    shards: StreamShards | None = None,
) -> Reconciled | None:
    """One check: reconcile if the primary changed since the last call, and again once the
    records the last reconcile found too young to judge are old enough."""
    try:
        changed = await watch.changed()
        if changed:
            log.warning("Redis primary changed; reconciling queued jobs")
        if changed or (watch.recheck_at is not None and time.time() >= watch.recheck_at):
            done = await reconcile(redis, keys, job_ttl_s, shards=shards)
            watch.recheck_at = done.judge_young_at
            return done
    except (RedisError, OSError) as exc:
        log.info("reconciliation deferred: %r", exc)
        watch.run_id = None if watch.run_id is None else "unknown"  # check again next time
    return None


class FailoverReconciler(BackgroundTask):
    """The API process's watch on the primary: every `every_s` it asks whose run id answers,
    and reconciles the queued jobs after a change (every API process may; it is idempotent)."""

    task_name = "failover-reconciler"

    def __init__(
        self,
        redis: ArqRedis,
        keys: Keys,
        job_ttl_s: int,
        shards: StreamShards | None = None,
        every_s: float = 2.0,
    ):
        self.redis, self.keys, self.job_ttl_s, self.every_s = redis, keys, job_ttl_s, every_s
        self.shards = shards
        self.watch = PrimaryWatch(redis)

    async def _run(self) -> None:
        while True:
            await reconcile_after_failover(
                self.watch, self.redis, self.keys, self.job_ttl_s, self.shards
            )
            await asyncio.sleep(self.every_s)

"""The API's Redis side of a job: admission (queue depth, per-key limit), enqueue with arq,
records, and cancellation (compare-and-set for a job still queued)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Coroutine
from typing import Any, get_args

from arq.connections import ArqRedis
from arq.constants import in_progress_key_prefix, job_key_prefix
from arq.jobs import serialize_job
from redis.exceptions import RedisError

from api.errors import APIError
from api.jobs.routing import PrefixRouter
from api.keys.limits import Quota, RateLimiter
from shared.config import Settings
from shared.contracts import (
    FINAL_STATUSES,
    QUEUED_GRACE_S,
    JobPayload,
    JobRecord,
    Lane,
    TokenReservation,
    cancelled_event,
    encode_event,
)
from shared.keys import Keys
from shared.queue import RUN_COMPLETION
from shared.ratelimit import settle_lua
from shared.relay_shards import StreamShards
from shared.replication import NotReplicated, ReplicaWaiter

log = logging.getLogger(__name__)


class NotConfirmed(APIError):
    """The job was queued, but no replica confirmed it: it may run, or vanish in a failover."""

    def __init__(self, job_id: str, reason: str) -> None:
        super().__init__(
            503,
            f"Job {job_id} was queued but Redis could not confirm it on a replica ({reason}); "
            f"it may still run: GET /v1/jobs/{job_id}, or retry with the same Idempotency-Key",
            error_type="service_unavailable",
            code="not_replicated",
            headers={"Retry-After": "1", "X-Job-Id": job_id},
        )


# Marks a job cancelled only while its record still says queued: a worker that took it in
# the meantime owns it from then on. Records are pydantic JSON (no spaces), so the status test
# is a plain substring match (quotes inside strings are escaped and cannot match).
_CANCEL_QUEUED = (
    """
local current = redis.call('GET', KEYS[1])
if not current or not string.find(current, '"status":"queued"', 1, true) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if KEYS[2] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[2])
  redis.call('EXPIRE', KEYS[2], ARGV[3])
end
if KEYS[3] ~= '' then redis.call('SREM', KEYS[3], ARGV[5]) end
redis.call('ZREM', KEYS[4], ARGV[5])
redis.call('DEL', KEYS[5])
redis.call('EXPIRE', KEYS[6], ARGV[3])
redis.call('EXPIRE', KEYS[7], ARGV[3])
"""
    + settle_lua(8, 6)
    + """return 1
"""
)
# A submission in one step: record, payload, the key's recent list, the routing hold, arq's
# job and its queue entry. Redis runs a script whole or not at all, and a replica or a new
# primary gets all of it or none: no failover leaves a record without its arq job. A record
# already there means this submission (redis-py sent it again after a dropped reply) or a
# batch line submitted before: nothing is written twice, so nothing runs twice.
_ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
if KEYS[3] ~= '' then
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[11])
  redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -tonumber(ARGV[5]) - 1)
  redis.call('EXPIRE', KEYS[3], ARGV[3])
end
if KEYS[4] ~= '' then redis.call('SET', KEYS[4], ARGV[6], 'PX', ARGV[7]) end
redis.call('SET', KEYS[5], ARGV[8], 'PX', ARGV[9])
redis.call('ZADD', KEYS[6], ARGV[10], ARGV[11])
return 1
"""
# Newest job ids kept per API key for `GET /v1/jobs` (the console's list); older ones drop.
RECENT_JOBS_KEPT = 200
# Queue entries looked at to tell running jobs from waiting ones (a console poll, 1/s).
_QUEUE_SCAN = 2000


def new_job_id() -> str:
    """Unguessable: the id is the only secret needed to read a job when keys are off."""
    return "job-" + secrets.token_urlsafe(16)


class JobStore:
    """Submit, read and cancel jobs."""

    def __init__(
        self,
        redis: ArqRedis,
        keys: Keys,
        settings: Settings,
        limiter: RateLimiter,
        shards: StreamShards | None = None,
        router: PrefixRouter | None = None,
    ) -> None:
        self.redis = redis
        self.router = router
        self.shards = shards or StreamShards(redis, [])
        self.keys = keys
        self.settings = settings
        self.limiter = limiter
        self.replicas = ReplicaWaiter(redis)
        self._cancel_queued = redis.register_script(_CANCEL_QUEUED)
        self._enqueue_script = redis.register_script(_ENQUEUE)
        self._background: set[asyncio.Task] = set()

    async def queue_depth(self, model: str, lane: Lane = "interactive") -> int:
        return int(await self.redis.zcard(self.keys.queue(model, lane)))

    async def submit(self, payload: JobPayload, url: str, quota: Quota | None = None) -> JobRecord:
        """Admit and enqueue; 429 (with Retry-After) when the key's rate limit, the queue or
        the key's unfinished jobs are full. Admitted tokens are given back by the final write."""
        reservation = await self.limiter.reserve(quota, payload) if quota else None
        try:
            await self._admit(payload)
        except APIError:
            await self.limiter.refund(reservation)
            raise
        try:
            worker_id = await self.router.pick(payload) if self.router else None
            # Not written means redis-py sent it again after a dropped reply: it is ours (the
            # id is unguessable), and it is queued.
            record, _ = await self._enqueue(
                payload, url, only_new=False, reservation=reservation, routed_to=worker_id
            )
        except (RedisError, OSError):
            await self._undo(payload, reservation)
            raise
        await self.redis.publish(self.keys.wake_channel, payload.id)
        await self._confirm_replicated(payload.id)
        return record

    async def _confirm_replicated(self, job_id: str) -> None:
        """Accept a job only once a replica holds it, when the primary has one: a failover
        just after the 202 must not take the job with it (shared/replication.py)."""
        num_required = await self.replicas.num_required()
        if not num_required:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            # A write on this connection: its WAIT then covers the whole submission before it.
            pipe.expire(self.keys.payload(job_id), QUEUED_GRACE_S + self.settings.job_ttl_s)
            self.replicas.add_wait(pipe, num_required)
            results = await pipe.execute()
        try:
            self.replicas.check(results, num_required)
        except NotReplicated as exc:
            raise NotConfirmed(job_id, str(exc)) from exc

    async def _undo(self, payload: JobPayload, reservation: TokenReservation | None) -> None:
        """Remove what a failed submission may have written (Redis went away after it ran
        the script, or refused a write at maxmemory): the client hears that nothing was
        queued, so nothing may run. DEL, ZREM and SREM are allowed even when Redis is full."""
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(self.keys.job(payload.id), self.keys.payload(payload.id))
                pipe.zrem(self.keys.queue(payload.model, payload.lane), payload.id)
                pipe.delete(job_key_prefix + payload.id)
                if payload.api_key_id:
                    pipe.srem(self.keys.key_jobs(payload.api_key_id), payload.id)
                await pipe.execute()
            await self.limiter.refund(reservation)
        except (RedisError, OSError) as exc:
            log.warning("could not undo a failed submission", extra={"error": repr(exc)})

    async def submit_line(self, payload: JobPayload, url: str) -> None:
        """Enqueue a batch line: no admission (its batch is the limit), and idempotent (the
        id is derived from the batch's): a line submitted again changes nothing."""
        await self._enqueue(payload, url, only_new=True)

    async def _enqueue(
        self,
        payload: JobPayload,
        url: str,
        only_new: bool,
        reservation: TokenReservation | None = None,
        routed_to: str | None = None,
    ) -> tuple[JobRecord, bool]:
        """Write record and payload and enqueue into the model's queue for the job's lane, in
        one script (`_ENQUEUE`); whether it wrote them (not when the record was there). A job
        `routed_to` a worker is held back for it (api/jobs/routing.py). `only_new`: a batch
        line, listed by its batch rather than the key's recent jobs."""
        record = JobRecord(
            id=payload.id,
            url=url,
            model=payload.model,
            lane=payload.lane,
            api_key_id=payload.api_key_id,
            request_id=payload.request_id,
            created_at=payload.created,
            reservation=reservation,
            routed_to=routed_to if self.settings.prefix_routing_hold_ms else None,
        )
        ttl = QUEUED_GRACE_S + self.settings.job_ttl_s
        recent = self.keys.recent_jobs(payload.api_key_id) if not only_new else ""
        routed = self.keys.routed(payload.id) if record.routed_to else ""
        now_ms = int(time.time() * 1000)
        arq_job = serialize_job(
            RUN_COMPLETION,
            (payload.model_dump_json(),),
            {},
            None,
            now_ms,
            serializer=self.redis.job_serializer,
        )
        written = await self._enqueue_script(
            keys=[
                self.keys.job(payload.id),
                self.keys.payload(payload.id),
                recent,
                routed,
                job_key_prefix + payload.id,
                self.keys.queue(payload.model, payload.lane),
            ],
            args=[
                record.model_dump_json(),
                payload.model_dump_json(),
                ttl,
                payload.created,
                RECENT_JOBS_KEPT,
                record.routed_to or "",
                self.settings.prefix_routing_hold_ms,
                arq_job,
                self.redis.expires_extra_ms,
                now_ms,
                payload.id,
            ],
        )
        return record, bool(written)

    async def cancel_queued(self, job_id: str) -> None:
        """Cancel a job only if it is still queued (batch cancel): a running one finishes.
        The cancel marker makes a worker that takes it meanwhile skip it."""
        ttl = QUEUED_GRACE_S + self.settings.job_ttl_s
        await self.redis.set(self.keys.cancelled(job_id), "1", ex=ttl)
        record = await self.get(job_id)
        if record is not None and record.status == "queued":
            await self._try_cancel_queued(record)

    async def _admit(self, payload: JobPayload) -> None:
        if await self.queue_depth(payload.model) >= self.settings.max_queue_depth:
            raise APIError(
                429,
                "The queue is full; retry later",
                code="queue_full",
                headers={"Retry-After": "2"},
            )
        if payload.api_key_id:
            await self._admit_key(payload.api_key_id, payload.id)

    async def _admit_key(self, key_id: str, job_id: str) -> None:
        key = self.keys.key_jobs(key_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.sadd(key, job_id)
            pipe.scard(key)
            pipe.expire(key, QUEUED_GRACE_S)
            _, count, _ = await pipe.execute()
        if count > self.settings.per_key_max_concurrent_jobs:
            await self.redis.srem(key, job_id)
            raise APIError(
                429,
                f"Too many unfinished jobs for this API key "
                f"(limit {self.settings.per_key_max_concurrent_jobs})",
                code="too_many_jobs",
                headers={"Retry-After": "1"},
            )

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(self.keys.job(job_id))
        return JobRecord.model_validate_json(raw) if raw else None

    async def get_owned(self, job_id: str, api_key_id: str | None) -> JobRecord:
        """The record, or 404 when it does not exist or belongs to another key."""
        record = await self.get(job_id)
        if record is None or record.api_key_id != api_key_id:
            raise APIError(404, f"No job with id '{job_id}'", param="job_id", code="job_not_found")
        return record

    async def recent(self, api_key_id: str | None, limit: int) -> list[JobRecord]:
        """The key's newest jobs, newest first; ids whose records expired are dropped."""
        key = self.keys.recent_jobs(api_key_id)
        ids = [i.decode() for i in await self.redis.zrevrange(key, 0, limit - 1)]
        raws = await self.redis.mget([self.keys.job(i) for i in ids]) if ids else []
        gone = [job_id for job_id, raw in zip(ids, raws, strict=True) if raw is None]
        if gone:
            await self.redis.zrem(key, *gone)
        return [JobRecord.model_validate_json(raw) for raw in raws if raw is not None]

    async def queue_depths(self, models: list[str]) -> list[dict[str, Any]]:
        """Jobs waiting and running in each model's queue per lane (arq keeps a running job
        in its queue until it ends: its in-progress key tells them apart)."""
        return [await self._queue_depth(model, lane) for model in models for lane in get_args(Lane)]

    async def _queue_depth(self, model: str, lane: str) -> dict[str, Any]:
        queue = self.keys.queue(model, lane)
        ids = await self.redis.zrange(queue, 0, _QUEUE_SCAN - 1)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zcard(queue)
            for job_id in ids:
                pipe.exists(in_progress_key_prefix + job_id.decode())
            total, *running = await pipe.execute()
        num_running = sum(running)
        return {
            "model": model,
            "lane": lane,
            "waiting": total - num_running,
            "running": num_running,
        }

    async def payload(self, job_id: str) -> JobPayload | None:
        raw = await self.redis.get(self.keys.payload(job_id))
        return JobPayload.model_validate_json(raw) if raw else None

    async def cancel(self, job_id: str) -> JobRecord | None:
        """Cancel: a queued job is finalised here; a running one is told to stop."""
        ttl = self.settings.job_ttl_s
        await self.redis.set(self.keys.cancelled(job_id), "1", ex=QUEUED_GRACE_S + ttl)
        record = await self.get(job_id)
        if record is None or record.status in FINAL_STATUSES:
            await self.redis.expire(self.keys.cancelled(job_id), ttl)  # no job left to stop
            return record
        if record.status == "queued" and await self._try_cancel_queued(record):
            return record
        await self.redis.publish(self.keys.cancel_channel, job_id)
        return await self.get(job_id)

    async def _try_cancel_queued(self, record: JobRecord) -> bool:
        event = cancelled_event()
        record.status, record.error, record.finished_at = "cancelled", event, time.time()
        reserved = record.reservation
        key_jobs = self.keys.key_jobs(record.api_key_id) if record.api_key_id else ""
        stream = self.keys.stream(record.id)
        on_main = not self.shards.is_sharded  # else the stream's shard gets it after the CAS
        done = await self._cancel_queued(
            keys=[
                self.keys.job(record.id),
                stream if on_main else "",
                key_jobs,
                self.keys.queue(record.model, record.lane),
                job_key_prefix + record.id,
                self.keys.payload(record.id),
                self.keys.cancelled(record.id),
                self.keys.rate_tokens(reserved.bucket) if reserved else "",
            ],
            args=[
                record.model_dump_json(),
                encode_event(event),
                self.settings.job_ttl_s,
                self.settings.stream_maxlen,
                record.id,
                reserved.second if reserved else 0,
                reserved.tokens if reserved else 0,  # it never ran: all of it back
            ],
        )
        if done and not on_main:
            async with self.shards.for_stream(stream).pipeline(transaction=False) as pipe:
                pipe.xadd(stream, {"data": encode_event(event)})
                pipe.expire(stream, self.settings.job_ttl_s)
                await pipe.execute()
        return bool(done)

    def cancel_soon(self, job_id: str) -> None:
        """Cancel from a place that may itself be cancelled (a disconnected client)."""
        self.spawn(self.cancel(job_id))

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("background job operation failed", extra={"error": repr(task.exception())})

    async def drain(self) -> None:
        if self._background:
            await asyncio.wait(list(self._background), timeout=5)

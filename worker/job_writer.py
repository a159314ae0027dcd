"""The worker's Redis writes: job records, stream events, final-state compare-and-set."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.contracts import FINAL_STATUSES, QUEUED_GRACE_S, JobRecord, encode_event
from shared.keys import Keys
from shared.ratelimit import settle_lua
from shared.relay_shards import StreamShards
from shared.retry import Backoff, retry

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Redis being away (down, restarting, loading its AOF) or refusing writes at maxmemory, as
# opposed to a bad command: each passes, so the job's writes wait and retry.
REDIS_DOWN_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    OutOfMemoryError,
    ConnectionError,
    OSError,
)
# How long a job's writes wait for Redis to come back before giving up (then logged).
WRITE_DEADLINE_S = 120.0
WRITE_BACKOFF = Backoff(first_s=0.05, max_s=2.0)


# The shared final statuses as a Lua table literal.
FINAL_STATUSES_LUA = "{" + ", ".join(f"'{status}'" for status in sorted(FINAL_STATUSES)) + "}"
# Lua: return 0 where the stored record (KEYS[1]) is final, else go on with `current` set.
# Records are pydantic JSON (no spaces), so the status test is a plain substring match.
_UNLESS_FINAL = """
local current = redis.call('GET', KEYS[1])
if current then
  for _, status in ipairs(FINAL_STATUSES_LUA) do
    if string.find(current, '"status":"' .. status .. '"', 1, true) then return 0 end
  end
end
""".replace("FINAL_STATUSES_LUA", FINAL_STATUSES_LUA)
# Marks a record in progress only where it is there and not final: 1 set, 0 final, -1 gone
# (the heartbeat puts it back). An attempt held up between reading the record and this write
# (a worker stopped past its lease) must not reopen a job another attempt has ended.
_START_SCRIPT = (
    _UNLESS_FINAL
    + """
if not current then return -1 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""
)
# Sets the record and appends the last event only while the stored record is not final.
_FINISH_SCRIPT = (
    _UNLESS_FINAL
    + """
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[2])
end
if KEYS[2] ~= '' then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
if KEYS[3] ~= '' then redis.call('SREM', KEYS[3], ARGV[5]) end
if ARGV[6] ~= '' then redis.call('SET', KEYS[4], ARGV[6], 'NX') end
redis.call('EXPIRE', KEYS[4], ARGV[3])
redis.call('EXPIRE', KEYS[5], ARGV[3])
"""
    + settle_lua(6, 7)
    + """return 1
"""
)


class JobWriter:
    """Every method waits out a Redis outage (retry with backoff up to `deadline_s`)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ttl_s: int,
        stream_maxlen: int,
        deadline_s: float = WRITE_DEADLINE_S,
        shards: StreamShards | None = None,
    ) -> None:
        self.redis = redis
        self.shards = shards or StreamShards(redis, [])
        self.keys = keys
        self.ttl_s = ttl_s
        self.stream_maxlen = stream_maxlen
        self.deadline_s = deadline_s
        self._finish = redis.register_script(_FINISH_SCRIPT)
        self._start = redis.register_script(_START_SCRIPT)

    async def _until_deadline(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Every job write: retried while Redis is away, given up after `deadline_s`."""
        return await retry(
            op,
            on=REDIS_DOWN_ERRORS,
            what=what,
            backoff=WRITE_BACKOFF,
            give_up_after_s=self.deadline_s,
        )

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self._until_deadline(
            lambda: self.redis.get(self.keys.job(job_id)), "reading a job"
        )
        return JobRecord.model_validate_json(raw) if raw else None

    async def is_cancelled(self, job_id: str) -> bool:
        key = self.keys.cancelled(job_id)
        return bool(await self._until_deadline(lambda: self.redis.exists(key), "reading a cancel"))

    async def mark_in_progress(self, record: JobRecord, attempt: int, worker_id: str) -> bool:
        """Record this attempt as running; False where the job ended meanwhile (skip it)."""
        record.status = "in_progress"
        record.attempts = attempt
        record.worker_id = worker_id
        record.started_at = record.started_at or time.time()
        keys = [self.keys.job(record.id)]
        args = [record.model_dump_json(), self.ttl_s + QUEUED_GRACE_S]
        started = await self._until_deadline(
            lambda: self._start(keys=keys, args=args), "marking a job in progress"
        )
        return int(started) != 0

    def restore(self, pipe: Redis, job_id: str, record_json: str, payload_json: str) -> None:
        """Queue writes that put back a running job's record and payload if Redis lost them
        (a restart without persistence); never overwrites what is there."""
        ttl = self.ttl_s + QUEUED_GRACE_S
        pipe.set(self.keys.job(job_id), record_json, ex=ttl, nx=True)
        pipe.set(self.keys.payload(job_id), payload_json, ex=ttl, nx=True)

    def append(self, pipe: Redis, job_id: str, event: object) -> None:
        """Queue one event on a pipeline (or client); streams expire if a job is abandoned."""
        stream = self.keys.stream(job_id)
        pipe.xadd(
            stream, {"data": encode_event(event)}, maxlen=self.stream_maxlen, approximate=True
        )

    async def append_now(self, job_id: str, event: object) -> None:
        client = self.shards.for_stream(self.keys.stream(job_id))

        async def write() -> None:
            async with client.pipeline(transaction=False) as pipe:
                self.append(pipe, job_id, event)
                pipe.expire(self.keys.stream(job_id), self.ttl_s + 3600)
                await pipe.execute()

        await self._until_deadline(write, "appending an event")

    async def finish(
        self,
        record: JobRecord,
        last_event: object | None,
        payload_json: str = "",
        used_tokens: int = 0,
    ) -> bool:
        """Write the final record (+ last event) unless the job is already final.

        `payload_json` goes back too where Redis lost it (a restart without persistence while
        the job ran): the job API builds its response from it. SET NX overwrites nothing.
        The same write gives the key's rate limit back what the job reserved beyond
        `used_tokens`, so that happens exactly once."""
        assert record.status in FINAL_STATUSES
        record.finished_at = time.time()
        key_jobs = self.keys.key_jobs(record.api_key_id) if record.api_key_id else ""
        reserved = record.reservation
        # With sharded streams the record's compare-and-set runs on the main Redis and its
        # winner alone appends the last event to the stream's shard after it.
        on_main = not self.shards.is_sharded
        keys = [
            self.keys.job(record.id),
            self.keys.stream(record.id) if on_main else "",
            key_jobs,
            self.keys.payload(record.id),
            self.keys.cancelled(record.id),  # expire with it
            self.keys.rate_tokens(reserved.bucket) if reserved else "",
        ]
        args = [
            record.model_dump_json(),
            encode_event(last_event) if last_event and on_main else "",
            self.ttl_s,
            self.stream_maxlen,
            record.id,
            payload_json,
            reserved.second if reserved else 0,
            max(reserved.tokens - used_tokens, 0) if reserved else 0,
        ]
        done = await self._until_deadline(
            lambda: self._finish(keys=keys, args=args), "writing a final record"
        )
        if done and not on_main:
            await self._append_last(record.id, last_event)
        return bool(done)

    async def _append_last(self, job_id: str, last_event: object | None) -> None:
        stream = self.keys.stream(job_id)
        client = self.shards.for_stream(stream)

        async def write() -> None:
            async with client.pipeline(transaction=False) as pipe:
                if last_event is not None:
                    self.append(pipe, job_id, last_event)
                pipe.expire(stream, self.ttl_s)
                await pipe.execute()

        await self._until_deadline(write, "appending the last event")

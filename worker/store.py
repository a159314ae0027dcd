"""The worker's Redis writes: job records, stream events, final-state compare-and-set."""

from __future__ import annotations

import time

from redis.asyncio import Redis

from shared.contracts import FINAL_STATUSES, JobRecord, encode_event
from shared.keys import Keys

# Sets the record and appends the last event only while the stored record is not final.
# Records are pydantic JSON (no spaces), so the status test is a plain substring match.
_FINISH_SCRIPT = """
local current = redis.call('GET', KEYS[1])
if current then
  for _, status in ipairs({'completed', 'failed', 'cancelled'}) do
    if string.find(current, '"status":"' .. status .. '"', 1, true) then return 0 end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'data', ARGV[2])
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
if KEYS[3] ~= '' then redis.call('SREM', KEYS[3], ARGV[5]) end
redis.call('EXPIRE', KEYS[4], ARGV[3])
redis.call('EXPIRE', KEYS[5], ARGV[3])
return 1
"""


class JobStore:
    def __init__(self, redis: Redis, keys: Keys, ttl_s: int, stream_maxlen: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self.stream_maxlen = stream_maxlen
        self._finish = redis.register_script(_FINISH_SCRIPT)

    async def get(self, job_id: str) -> JobRecord | None:
        raw = await self.redis.get(self.keys.job(job_id))
        return JobRecord.model_validate_json(raw) if raw else None

    async def is_cancelled(self, job_id: str) -> bool:
        return bool(await self.redis.exists(self.keys.cancelled(job_id)))

    async def mark_in_progress(self, record: JobRecord, attempt: int, worker_id: str) -> None:
        record.status = "in_progress"
        record.attempts = attempt
        record.worker_id = worker_id
        record.started_at = record.started_at or time.time()
        await self.redis.set(self.keys.job(record.id), record.model_dump_json(),
                             ex=self.ttl_s, xx=True)

    def append(self, pipe: Redis, job_id: str, event: object) -> None:
        """Queue one event on a pipeline (or client); streams expire if a job is abandoned."""
        stream = self.keys.stream(job_id)
        pipe.xadd(stream, {"data": encode_event(event)}, maxlen=self.stream_maxlen,
                  approximate=True)

    async def append_now(self, job_id: str, event: object) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            self.append(pipe, job_id, event)
            pipe.expire(self.keys.stream(job_id), self.ttl_s + 3600)
            await pipe.execute()

    async def finish(self, record: JobRecord, last_event: object | None) -> bool:
        """Write the final record (+ last event) unless the job is already final."""
        assert record.status in FINAL_STATUSES
        record.finished_at = time.time()
        key_jobs = self.keys.key_jobs(record.api_key_id) if record.api_key_id else ""
        done = await self._finish(
            keys=[self.keys.job(record.id), self.keys.stream(record.id), key_jobs,
                  self.keys.payload(record.id), self.keys.cancelled(record.id)],
            args=[record.model_dump_json(), encode_event(last_event) if last_event else "",
                  self.ttl_s, self.stream_maxlen, record.id],
        )
        return bool(done)

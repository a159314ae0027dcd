"""One batch line: submitted as a job of the batch lane, and its result recorded exactly once.

A line's result is one field of the batch's results hash, written with HSETNX by a Lua
script that counts it in the same step: whoever records a line first (the expander for an
invalid line, the collector for a finished job, the stopper for a cancelled or expired one)
decides it, and nothing can write it twice. That is the "exactly one output or error line
per input line" of DESIGN.md.
"""

from __future__ import annotations

import json
from typing import Any

from api.batches.contracts import NO_OWNER, BatchRecord, line_job_id
from api.batches.files import BatchLine
from api.errors import APIError
from api.openai.admission import parse_dict, prepare_job, response_context
from api.openai.formatting import build_response
from api.openai.protocol import ChatCompletionRequest, CompletionRequest
from api.services import Services
from shared.contracts import JobRecord
from shared.keys import Keys

_RECORD_RESULT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return 1
end
return 0
"""
STOP_MESSAGES = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}


class LineResults:
    """The batch's results hash and counts."""

    def __init__(self, services: Services, ttl_s: int) -> None:
        self.redis = services.redis
        self.keys: Keys = services.keys
        self.ttl_s = ttl_s
        self._script = services.redis.register_script(_RECORD_RESULT)

    async def record(self, batch_id: str, line: int, kind: str, entry: dict[str, Any]) -> bool:
        """Record line `line`'s result (`kind` ok or err) unless it already has one."""
        keys = [self.keys.batch_results(batch_id), self.keys.batch_counts(batch_id)]
        value = json.dumps({"kind": kind, "line": entry}, separators=(",", ":"))
        return bool(await self._script(keys=keys, args=[line, value, kind, self.ttl_s]))

    async def done_lines(self, batch_id: str) -> set[int]:
        return {int(k) for k in await self.redis.hkeys(self.keys.batch_results(batch_id))}

    async def counts(self, batch_id: str) -> tuple[int, int]:
        ok, err = await self.redis.hmget(self.keys.batch_counts(batch_id), ["ok", "err"])
        return int(ok or 0), int(err or 0)

    async def all(self, batch_id: str) -> dict[int, dict[str, Any]]:
        raw = await self.redis.hgetall(self.keys.batch_results(batch_id))
        return {int(k): json.loads(v) for k, v in raw.items()}


def request_entry(job_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An output or error file line (custom_id is added when the file is written)."""
    return {
        "id": f"batch_req_{job_id}",
        "response": {"status_code": status, "request_id": job_id, "body": body},
        "error": None,
    }


def stopped_entry(job_id: str, code: str) -> dict[str, Any]:
    """The error line of a request a cancelled or expired batch never ran."""
    return {
        "id": f"batch_req_{job_id}",
        "response": None,
        "error": {"code": code, "message": STOP_MESSAGES[code]},
    }


def api_key_of(batch: BatchRecord) -> str | None:
    return None if batch.owner == NO_OWNER else batch.owner


async def submit_line(
    services: Services, results: LineResults, batch: BatchRecord, line: BatchLine
) -> None:
    """Validate and enqueue one line as a batch-lane job; a request error becomes its error
    line at once. Transient failures (5xx: Redis, tokenizer) raise, and the expansion is
    retried (the line's derived job id makes that harmless)."""
    job_id = line_job_id(batch.id, line.index)
    model = CompletionRequest if line.url == "/v1/completions" else ChatCompletionRequest
    try:
        body = parse_dict({**line.body, "stream": False}, model)
        payload = await prepare_job(
            services,
            body,
            api_key_id=api_key_of(batch),
            deadline_s=None,
            job_id=job_id,
            lane="batch",
            priority_range=batch.priority_range,
        )
    except APIError as exc:
        if exc.status >= 500:
            raise
        await results.record(
            batch.id, line.index, "err", request_entry(job_id, exc.status, exc.body())
        )
        return
    await services.jobs.submit_line(payload, line.url)


async def finished_entry(
    services: Services, record: JobRecord, stop_code: str = "batch_cancelled"
) -> tuple[str, dict[str, Any]]:
    """A final job record as (kind, file line); a cancelled line was stopped by its batch's
    cancel or expiry (`stop_code`)."""
    if record.status == "completed" and record.result is not None:
        payload = await services.jobs.payload(record.id)
        if payload is not None:
            ctx = await response_context(services, payload, include_usage=False)
            body = build_response(ctx, record.result.choices, record.result.usage)
            return "ok", request_entry(record.id, 200, body)
    if record.status == "cancelled":
        return "err", stopped_entry(record.id, stop_code)
    error = record.error
    if error is None:
        error_body = APIError(500, "The request's result was lost").body()
        return "err", request_entry(record.id, 500, error_body)
    return "err", request_entry(record.id, error.status, APIError.from_event(error).body())

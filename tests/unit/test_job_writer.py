"""The worker's job writes never reopen an ended job: an attempt that was stopped between
reading the record and marking it in progress (past its lease, while another attempt ran the
job to its end) is told to skip, and the record and stream keep their one terminal event."""

from __future__ import annotations

import asyncio
import json

import fakeredis

from shared.contracts import DoneEvent, JobRecord, Usage
from shared.keys import Keys
from worker.job_writer import JobWriter

KEYS = Keys("writer-test")


def _record(status: str = "queued") -> JobRecord:
    return JobRecord(id="job-1", status=status, url="/v1/completions", model="m")  # type: ignore[arg-type]


def _done() -> DoneEvent:
    return DoneEvent(choices=[], usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2))


def test_a_late_attempt_cannot_reopen_a_job_another_attempt_ended() -> None:
    async def scenario() -> tuple[bool, bool, dict, list[str]]:
        redis = fakeredis.FakeAsyncRedis()
        writer = JobWriter(redis, KEYS, ttl_s=600, stream_maxlen=100)
        await redis.set(KEYS.job("job-1"), _record().model_dump_json())
        late = _record()  # attempt 1 read the record, then its worker stopped
        ended = _record()
        assert await writer.mark_in_progress(ended, attempt=2, worker_id="w2")
        ended.status = "completed"
        assert await writer.finish(ended, _done())
        started = await writer.mark_in_progress(late, attempt=1, worker_id="w1")
        finished_again = await writer.finish(_record("completed"), _done())
        stored = json.loads(await redis.get(KEYS.job("job-1")))
        events = await redis.xrange(KEYS.stream("job-1"))
        return started, finished_again, stored, [json.loads(f[b"data"])["type"] for _, f in events]

    started, finished_again, stored, types = asyncio.run(scenario())
    assert started is False and finished_again is False
    assert stored["status"] == "completed" and stored["worker_id"] == "w2"
    assert stored["attempts"] == 2
    assert types == ["done"]


def test_mark_in_progress_sets_a_live_record_and_recreates_no_missing_one() -> None:
    async def scenario() -> tuple[bool, dict, int, bool, bool]:
        redis = fakeredis.FakeAsyncRedis()
        writer = JobWriter(redis, KEYS, ttl_s=600, stream_maxlen=100)
        await redis.set(KEYS.job("job-1"), _record().model_dump_json())
        started = await writer.mark_in_progress(_record(), attempt=3, worker_id="w1")
        stored = json.loads(await redis.get(KEYS.job("job-1")))
        ttl = await redis.ttl(KEYS.job("job-1"))
        gone = await writer.mark_in_progress(
            JobRecord(id="job-2", url="/v1/completions", model="m"),
            attempt=1,
            worker_id="w1",
        )
        return started, stored, ttl, gone, bool(await redis.exists(KEYS.job("job-2")))

    started, stored, ttl, gone, recreated = asyncio.run(scenario())
    assert started is True
    assert stored["status"] == "in_progress" and stored["attempts"] == 3
    assert stored["worker_id"] == "w1" and ttl > 600  # the job TTL plus the queued grace
    assert gone is True and recreated is False  # runs on; the heartbeat puts it back

"""A submission is one script: record, payload, arq's job and its queue entry together, and
written once even when redis-py sends it again after a dropped reply (a failover)."""

from __future__ import annotations

import asyncio

import fakeredis
from arq.connections import ArqRedis
from arq.constants import job_key_prefix

from api.jobs.store import JobStore
from api.keys.limits import RateLimiter
from shared.config import Settings
from shared.contracts import JobPayload, JobRecord
from shared.keys import Keys
from shared.queue import RUN_COMPLETION, deserialize_job, serialize_job


def _store() -> tuple[JobStore, ArqRedis, Keys]:
    redis = ArqRedis(
        connection_pool=fakeredis.FakeAsyncRedis().connection_pool,
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
    )
    keys = Keys("p")
    settings = Settings(_env_file=None, key_prefix="p")
    return JobStore(redis, keys, settings, RateLimiter(redis, keys)), redis, keys


def _payload(job_id: str) -> JobPayload:
    return JobPayload(id=job_id, endpoint="completions", model="m", prompt_token_ids=[1, 2, 3])


def test_a_submission_writes_what_arq_and_the_api_read() -> None:
    async def scenario() -> None:
        store, redis, keys = _store()
        payload = _payload("job-1")
        record, written = await store._enqueue(payload, "/v1/completions", only_new=False)
        assert written and (await store.get("job-1")) == record
        assert (await store.payload("job-1")) == payload
        job = deserialize_job(await redis.get(job_key_prefix + "job-1"))
        assert job["f"] == RUN_COMPLETION and job["a"] == [payload.model_dump_json()]
        assert await redis.zscore(keys.queue("m"), "job-1") == job["et"]
        assert await redis.zrange(keys.recent_jobs(None), 0, -1) == [b"job-1"]
        info = await redis.queued_jobs(queue_name=keys.queue("m"))  # arq reads it back
        assert [(j.job_id, j.function) for j in info] == [("job-1", RUN_COMPLETION)]

    asyncio.run(scenario())


def test_a_submission_sent_again_after_a_lost_reply_changes_nothing() -> None:
    """A worker may have taken the job before the resend: its record must stay as it is."""

    async def scenario() -> None:
        store, redis, keys = _store()
        payload = _payload("job-1")
        await store._enqueue(payload, "/v1/completions", only_new=False)
        taken = (await store.get("job-1")).model_copy(update={"status": "in_progress"})
        await redis.set(keys.job("job-1"), taken.model_dump_json())
        await redis.zrem(keys.queue("m"), "job-1")  # as a worker finishing it would
        _, written = await store._enqueue(payload, "/v1/completions", only_new=False)
        assert not written
        assert (await store.get("job-1")).status == "in_progress"
        assert await redis.zcard(keys.queue("m")) == 0  # not queued to run twice

    asyncio.run(scenario())


def test_a_batch_line_submitted_again_after_it_ran_is_not_run_again() -> None:
    async def scenario() -> None:
        store, redis, keys = _store()
        payload = _payload("line-1")
        await store.submit_line(payload, "/v1/completions")
        record = JobRecord.model_validate_json(await redis.get(keys.job("line-1")))
        done = record.model_copy(update={"status": "completed"})
        await redis.set(keys.job("line-1"), done.model_dump_json())
        await redis.delete(job_key_prefix + "line-1")
        await redis.zrem(keys.queue("m"), "line-1")
        await store.submit_line(payload, "/v1/completions")
        assert not await redis.exists(job_key_prefix + "line-1")
        assert await redis.zcard(keys.queue("m")) == 0
        assert await redis.zcard(keys.recent_jobs(None)) == 0  # lines are listed by their batch

    asyncio.run(scenario())


def test_undoing_a_failed_submission_leaves_nothing_to_run() -> None:
    async def scenario() -> None:
        store, redis, keys = _store()
        payload = _payload("job-1")
        await store._enqueue(payload, "/v1/completions", only_new=False)
        await store._undo(payload, None)
        for key in (keys.job("job-1"), keys.payload("job-1"), job_key_prefix + "job-1"):
            assert not await redis.exists(key)
        assert await redis.zcard(keys.queue("m")) == 0

    asyncio.run(scenario())

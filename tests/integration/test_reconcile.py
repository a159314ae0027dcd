"""Reconciliation after a primary change: a `queued` record without its arq job is queued
again from its payload, or failed with `job_lost`; everything else is left alone."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from arq.connections import ArqRedis, create_pool
from arq.constants import job_key_prefix

from api.jobs.reconcile import MIN_AGE_S, PrimaryWatch, reconcile, reconcile_after_failover
from shared.contracts import JobPayload, JobRecord, decode_event
from shared.keys import Keys
from shared.queue import deserialize_job, serialize_job
from shared.redis_url import arq_redis_settings
from tests.support.harness import TEST_REDIS_URL, cleanup_keys


@pytest.fixture
async def redis() -> AsyncIterator[tuple[ArqRedis, Keys]]:
    keys = Keys(f"ladletest-{uuid.uuid4().hex[:8]}")
    pool = await create_pool(
        arq_redis_settings(TEST_REDIS_URL),
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
    )
    yield pool, keys
    await pool.aclose()
    cleanup_keys(keys.prefix)


async def _record(
    redis: ArqRedis, keys: Keys, name: str, *, age_s: float, payload: bool, status: str = "queued"
) -> str:
    job_id = f"job-{name}-{uuid.uuid4().hex[:6]}"
    created = time.time() - age_s
    record = JobRecord(
        id=job_id, url="/v1/completions", model="m", status=status, created_at=created
    )
    await redis.set(keys.job(job_id), record.model_dump_json(), ex=600)
    if payload:
        body = JobPayload(id=job_id, endpoint="completions", model="m", prompt_token_ids=[1])
        await redis.set(keys.payload(job_id), body.model_dump_json(), ex=600)
    return job_id


async def test_queued_records_without_a_queue_entry_are_requeued_or_failed(
    redis: tuple[ArqRedis, Keys],
) -> None:
    pool, keys = redis
    lost_enqueue = await _record(pool, keys, "requeue", age_s=60, payload=True)
    lost_payload = await _record(pool, keys, "nopayload", age_s=60, payload=False)
    recent = await _record(pool, keys, "recent", age_s=0, payload=True)
    running = await _record(pool, keys, "running", age_s=60, payload=True, status="in_progress")
    queued_ok = await _record(pool, keys, "ok", age_s=60, payload=True)
    await pool.enqueue_job("run_completion", "{}", _job_id=queued_ok, _queue_name=keys.queue("m"))

    done = await reconcile(pool, keys, job_ttl_s=600)

    assert done.requeued == [lost_enqueue] and done.failed == [lost_payload]
    assert await pool.exists(job_key_prefix + lost_enqueue)
    assert await pool.zscore(keys.queue("m"), lost_enqueue) is not None
    failed = JobRecord.model_validate_json(await pool.get(keys.job(lost_payload)))
    assert failed.status == "failed" and failed.error is not None
    assert failed.error.code == "job_lost" and failed.error.status == 503
    (entry,) = await pool.xrange(keys.stream(lost_payload))
    assert decode_event(entry[1][b"data"]).code == "job_lost"  # its waiting client hears it
    for untouched in (recent, running):
        assert not await pool.exists(job_key_prefix + untouched)
    assert (await reconcile(pool, keys, job_ttl_s=600)).requeued == []  # once is enough


async def test_primary_watch_reports_no_change_on_the_same_server(
    redis: tuple[ArqRedis, Keys],
) -> None:
    watch = PrimaryWatch(redis[0])
    assert not await watch.changed()  # the first look only learns the run id
    assert watch.run_id and not await watch.changed()


async def test_a_record_too_young_at_the_failover_is_judged_once_old_enough(
    redis: tuple[ArqRedis, Keys],
) -> None:
    """A submission cut off by the failover itself is the youngest record then: the watch
    comes back to it without another primary change."""
    pool, keys = redis
    young = await _record(pool, keys, "young", age_s=1, payload=True)
    watch = PrimaryWatch(pool)
    watch.run_id = "the-old-primary"

    first = await reconcile_after_failover(watch, pool, keys, job_ttl_s=600)

    assert first is not None and first.requeued == [] and watch.recheck_at is not None
    record = JobRecord.model_validate_json(await pool.get(keys.job(young)))
    assert watch.recheck_at == pytest.approx(record.created_at + MIN_AGE_S)
    assert await reconcile_after_failover(watch, pool, keys, job_ttl_s=600) is None  # not yet
    watch.recheck_at = time.time()  # as if min_age_s had passed, with the record aged too
    await pool.set(keys.job(young), record.model_copy(update={"created_at": 0}).model_dump_json())

    again = await reconcile_after_failover(watch, pool, keys, job_ttl_s=600)

    assert again is not None and again.requeued == [young] and watch.recheck_at is None
    assert await pool.zscore(keys.queue("m"), young) is not None

"""Each attempt of a job has its own id in the engine; outputs of another attempt are stale."""

from __future__ import annotations

import asyncio

from shared.contracts import JobPayload, SamplingSpec
from worker.job_state import JobState, job_for, new_engine_request_id


def _job(loop: asyncio.AbstractEventLoop, attempt: int) -> JobState:
    payload = JobPayload(
        id="job~with-tilde",
        endpoint="completions",
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingSpec(max_tokens=4),
    )
    return JobState.create(payload, attempt, [1, 2], loop)


def test_attempts_get_distinct_engine_ids_that_route_back_to_their_job() -> None:
    loop = asyncio.new_event_loop()
    try:
        first, second = _job(loop, 1), _job(loop, 2)
    finally:
        loop.close()
    assert first.engine_request_id != second.engine_request_id
    assert first.engine_request_id.startswith("job~with-tilde~")
    jobs = {"job~with-tilde": second}  # attempt 2 now runs on this worker
    assert job_for(jobs, second.engine_request_id) is second
    assert job_for(jobs, first.engine_request_id) is None  # attempt 1's late outputs: dropped
    assert job_for(jobs, "other-job~0000") is None
    assert job_for({}, second.engine_request_id) is None
    assert new_engine_request_id("a") != new_engine_request_id("a")

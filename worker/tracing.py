"""The worker's spans for one attempt of a job, recorded when the attempt ends from the
timestamps the job already keeps (Timings), so the engine's loop does no tracing work.

Under the API's request span (the payload's traceparent): `queue.wait` (first attempt:
enqueued -> picked up) and `worker.job` (one per attempt) with `worker.setup`,
`engine.queue`, `engine.prefill`, `engine.decode` and `worker.publish` (the final write)."""

from __future__ import annotations

import time

from shared import tracing
from worker.job_state import JobState


def record_attempt(
    job: JobState,
    worker_id: str,
    outcome: str,
    publish: tuple[float, float] | None = None,
) -> None:
    """Spans for the attempt that just ended with `outcome` (completed, handed_back, ...)."""
    if not tracing.enabled():
        return
    payload, t = job.payload, job.timings
    ended = t.finished_at or time.time()
    usage = job.usage()
    attributes = {
        "ladle.job_id": payload.id,
        "ladle.attempt": job.attempt,
        "ladle.worker_id": worker_id,
        "ladle.outcome": outcome,
        "gen_ai.request.model": payload.model,
        "gen_ai.usage.input_tokens": usage.prompt_tokens,
        "gen_ai.usage.output_tokens": usage.completion_tokens,
    }
    ids = {"ladle.job_id": payload.id, "ladle.attempt": job.attempt}
    if job.attempt == 1:
        tracing.record_span("queue.wait", payload.traceparent, t.queued_at, t.picked_at, ids)
    root = tracing.start_span("worker.job", payload.traceparent, attributes, start=t.picked_at)
    tracing.record_span("worker.setup", root, t.picked_at, t.started_at, ids)
    tracing.record_span("engine.queue", root, t.started_at, t.scheduled_at, ids)
    tracing.record_span("engine.prefill", root, t.scheduled_at, t.first_token_at, ids)
    decoded = job.last_token_at or ended  # the final write (publish) comes after
    tracing.record_span("engine.decode", root, t.first_token_at, decoded, ids)
    if publish is not None:
        tracing.record_span("worker.publish", root, publish[0], publish[1], ids)
        ended = publish[1]
    tracing.end_span(root, end=ended, error=None if outcome == "completed" else outcome)

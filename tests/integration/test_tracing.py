"""One trace per job, across the API and the worker and a retried attempt, in phase order.

The API app (in process, httpx's ASGI transport) and a real WorkerService with a tiny engine
share the real Redis and an in-memory span exporter; the test plays arq's part: it takes the
job from the queue, hands the first attempt back mid-decode (as a draining worker does), and
runs it again as attempt 2.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from arq.constants import job_key_prefix
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.app import create_app, make_redis
from shared import tracing
from shared.contracts import JobPayload
from shared.keys import Keys
from shared.queue import deserialize_job
from shared.tokenizer import load_tokenizer
from tests.support.engines import assert_all_blocks_free, make_engine
from tests.unit.api_harness import _cleanup, make_settings
from tests.unit.fake_worker import FakeWorker
from worker.service import HandBack, WorkerService

MODEL = "tiny"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    spans = InMemorySpanExporter()
    tracing.use_exporter(spans)
    yield spans
    tracing.shutdown()


async def take_job(redis: object, keys: Keys) -> JobPayload:
    """What arq does: pop the queue, read the job's payload."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        popped = await redis.zpopmin(keys.queue(MODEL))  # type: ignore[attr-defined]
        if popped:
            raw = await redis.get(job_key_prefix + popped[0][0].decode())  # type: ignore[attr-defined]
            return JobPayload.model_validate_json(deserialize_job(raw)["a"][0])
        await asyncio.sleep(0.005)
    raise TimeoutError("no job was enqueued")


async def run_two_attempts(service: WorkerService, payload: JobPayload) -> str:
    """Attempt 1 is handed back once it has tokens; attempt 2 runs to the end."""
    first = asyncio.create_task(service.run_job(payload, 1))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = service.jobs.get(payload.id)
        if job is not None and job.timings.first_token_at is not None:
            break
        await asyncio.sleep(0.001)
    assert service.hand_back_all() == [payload.id]
    with pytest.raises(HandBack):
        await first
    await engine_forgot(service, payload.id)
    return await service.run_job(payload, 2)


async def engine_forgot(service: WorkerService, request_id: str) -> None:
    """Wait until the aborted attempt is out of the engine and its last outputs are through
    the publisher: a retry runs elsewhere or later, never into the old attempt's tail."""
    deadline = time.monotonic() + 30
    quiet = 0
    while quiet < 3 and time.monotonic() < deadline:
        held = {held.rsplit("~", 1)[0] for held in service.engine.request_ids()}  # job~attempt
        busy = request_id in held or not service.publisher._outputs.empty()
        quiet = 0 if busy else quiet + 1
        await asyncio.sleep(0.01)


async def test_one_trace_spans_api_and_worker_across_a_retry(
    exporter: InMemorySpanExporter, tiny_service_model: Path
) -> None:
    settings = make_settings(model_name=str(tiny_service_model), served_model_name=MODEL)
    keys = Keys(settings.key_prefix)
    redis = make_redis(settings, keys)
    app = create_app(settings, redis=redis, tokenizer_loader=lambda s: load_tokenizer(s.model_name))
    await FakeWorker(redis, keys).register(model=MODEL, max_model_len=512)
    engine = make_engine(tiny_service_model)
    service = WorkerService(
        settings, engine, load_tokenizer(str(tiny_service_model)), redis, "trace-worker"
    )
    service.start()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "w5 w6 w7"}],
        "max_tokens": 300,
        "ignore_eos": True,
        "temperature": 0,
    }
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            request = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            taken = asyncio.create_task(take_job(redis, keys))
            await asyncio.wait({request, taken}, return_when=asyncio.FIRST_COMPLETED)
            assert not request.done(), request.result().text
            status = await run_two_attempts(service, await taken)
            response = await request
    finally:
        await service.stop()
        await app.state.services.relay.stop()
        await _cleanup(redis, settings.key_prefix)
        await redis.aclose()
    assert status == "completed" and response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 300
    assert_all_blocks_free(engine)
    check_trace(exporter.get_finished_spans(), response.headers["x-job-id"])


def check_trace(spans: tuple, job_id: str) -> None:
    assert len({s.context.trace_id for s in spans}) == 1  # one trace for the whole job
    by_name: dict[str, list] = {}
    for s in sorted(spans, key=lambda s: s.start_time):
        by_name.setdefault(s.name, []).append(s)
    root = one(by_name, "POST /v1/chat/completions")
    assert root.parent is None and root.attributes["ladle.job_id"] == job_id
    attempts = by_name["worker.job"]
    assert [a.attributes["ladle.attempt"] for a in attempts] == [1, 2]
    assert [a.attributes["ladle.outcome"] for a in attempts] == ["HandBack", "completed"]
    assert attempts[1].attributes["gen_ai.usage.output_tokens"] == 300
    for name in ("api.enqueue", "queue.wait", "api.relay", *[a.name for a in attempts]):
        assert all(s.parent.span_id == root.context.span_id for s in by_name[name]), name
    # The phases in order: receive -> enqueue -> pick-up -> (attempt 1, handed back) ->
    # attempt 2: setup -> engine queue -> prefill -> decode -> publish -> relay -> response.
    enqueue, queued = one(by_name, "api.enqueue"), one(by_name, "queue.wait")
    assert root.start_time <= enqueue.start_time <= queued.end_time <= attempts[0].start_time
    assert attempts[0].end_time <= attempts[1].start_time
    phases = [
        s
        for name in ("worker.setup", "engine.queue", "engine.prefill", "engine.decode")
        for s in by_name[name]
        if s.parent.span_id == attempts[1].context.span_id
    ]
    phases.append(one(by_name, "worker.publish"))
    names = [s.name.split(".")[1] for s in phases]
    assert names == ["setup", "queue", "prefill", "decode", "publish"]
    for earlier, later in zip(phases, phases[1:], strict=False):
        assert earlier.end_time <= later.start_time, (earlier.name, later.name)
    relay = one(by_name, "api.relay")
    # The relay may answer from the final entry before the worker's write call returns.
    assert phases[-1].start_time <= relay.end_time <= root.end_time


def one(by_name: dict[str, list], name: str) -> object:
    assert len(by_name.get(name, [])) == 1, (name, sorted(by_name))
    return by_name[name][0]

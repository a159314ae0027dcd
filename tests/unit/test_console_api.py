"""What the console reads: its static files, the per-key job list, queue depths, the fleet's
tokens/s; and tracing, which is off (no spans, no traceparent) unless configured."""

from __future__ import annotations

import asyncio

import pytest
from arq.constants import in_progress_key_prefix
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from api.jobs import store as api_jobs
from shared import tracing
from shared.config import Settings
from tests.unit.api_harness import harness

pytestmark = pytest.mark.redis
KEY_A, KEY_B = "key-a-secret", "key-b-secret"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
CHAT = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]}


async def test_console_files_are_served_with_a_strict_policy() -> None:
    async with harness(api_keys=[KEY_A]) as h:
        for path in ("/", "/console"):
            r = await h.client.get(path)  # no key needed: the page holds no data
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert 'data-auth="required"' in r.text and "{{auth}}" not in r.text
            assert r.headers["content-security-policy"].startswith("default-src 'self'")
        for name, media in (("main.js", "text/javascript"), ("console.css", "text/css")):
            r = await h.client.get(f"/console/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(media)
        for name in ("nope.js", "index.html", "..%2Fapp.py"):
            r = await h.client.get(f"/console/{name}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        assert (await h.client.get("/health")).json() == {"status": "ok"}
    async with harness() as h:
        assert 'data-auth="none"' in (await h.client.get("/")).text


async def test_console_scripts_fetch_nothing_from_elsewhere() -> None:
    async with harness() as h:
        for name in ("index.html", "main.js", "api.js", "playground.js", "fleet.js", "jobs.js"):
            path = "/" if name == "index.html" else f"/console/{name}"
            text = (await h.client.get(path)).text
            assert "http://" not in text and "https://" not in text, name


async def test_job_list_is_per_key_newest_first_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(api_jobs, "RECENT_JOBS_KEPT", 3)
    async with harness(api_keys=[KEY_A, KEY_B]) as h:
        ids = []
        for _ in range(4):
            r = await h.client.post("/v1/chat/completions", json=CHAT, headers=A)
            ids.append(r.headers["x-job-id"])
        await h.client.post("/v1/chat/completions", json=CHAT, headers=B)
        listed = (await h.client.get("/v1/jobs", headers=A)).json()
        assert listed["object"] == "list"
        assert [j["id"] for j in listed["data"]] == ids[::-1][:3]  # the oldest dropped
        job = listed["data"][0]
        assert job["status"] == "completed" and job["response"] is None
        assert job["timings"] is None or "picked_at" in job["timings"]
        limited = (await h.client.get("/v1/jobs?limit=1", headers=A)).json()["data"]
        assert [j["id"] for j in limited] == [ids[-1]]
        await h.redis.delete(h.keys.job(ids[-1]))  # expired: dropped from the list too
        assert ids[-1] not in [
            j["id"] for j in (await h.client.get("/v1/jobs", headers=A)).json()["data"]
        ]
        assert len((await h.client.get("/v1/jobs", headers=B)).json()["data"]) == 1
        for bad in ("0", "101", "x"):
            r = await h.client.get(f"/v1/jobs?limit={bad}", headers=A)
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit"
        assert (await h.client.get("/v1/jobs")).status_code == 401


async def test_queue_depths_tell_waiting_from_running_jobs() -> None:
    async with harness(start_worker=False) as h:
        for _ in range(3):
            assert (
                await h.client.post("/v1/jobs", json={"url": "/v1/chat/completions", "body": CHAT})
            ).status_code == 202
        queued = [m.decode() for m in await h.redis.zrange(h.keys.queue("test-model"), 0, -1)]
        await h.redis.set(in_progress_key_prefix + queued[0], b"1", px=5000)
        try:
            body = (await h.client.get("/v1/queues")).json()
        finally:
            await h.redis.delete(in_progress_key_prefix + queued[0])
        assert body == {
            "object": "list",
            "data": [
                {"model": "test-model", "lane": "interactive", "waiting": 2, "running": 1},
                {"model": "test-model", "lane": "batch", "waiting": 0, "running": 0},
            ],
        }


async def test_workers_report_tokens_per_second() -> None:
    async with harness() as h:
        worker = (await h.client.get("/v1/workers")).json()["data"][0]
        assert worker["tokens_per_s"] == 0.0


async def test_tracing_is_off_unless_configured() -> None:
    assert not tracing.enabled() and tracing.start_span("x") is None
    assert tracing.record_span("x", None, 1.0, 2.0) is None
    async with harness() as h:
        r = await h.client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and h.worker.payloads[0].traceparent is None


async def test_a_traced_request_carries_its_traceparent_to_the_worker() -> None:
    spans = InMemorySpanExporter()
    tracing.use_exporter(spans)
    try:
        async with harness() as h:
            r = await h.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
            assert r.status_code == 200
            await asyncio.sleep(0)
        names = {s.name: s for s in spans.get_finished_spans()}
        root = names["POST /v1/chat/completions"]
        trace_id, span_id = f"{root.context.trace_id:032x}", f"{root.context.span_id:016x}"
        assert h.worker.payloads[0].traceparent.startswith(f"00-{trace_id}-{span_id}-")
        assert names["api.enqueue"].parent.span_id == root.context.span_id
        assert names["api.relay"].parent.span_id == root.context.span_id
        assert root.attributes["gen_ai.usage.output_tokens"] == 5
    finally:
        tracing.shutdown()


def test_otlp_endpoint_settings() -> None:
    assert Settings(_env_file=None).otel_endpoint is None
    assert tracing.otlp_traces_url("http://jaeger:4318") == "http://jaeger:4318/v1/traces"
    assert tracing.otlp_traces_url("http://c:4318/v1/traces/") == "http://c:4318/v1/traces"

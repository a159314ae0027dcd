"""The job API: submit, poll, events (replay and Last-Event-ID resume), cancel, ownership."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.api_harness import harness

pytestmark = pytest.mark.redis
CHAT = {
    "url": "/v1/chat/completions",
    "body": {
        "model": "test-model",
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
    },
}


async def _wait_final(client, job_id: str, headers: dict | None = None) -> dict:
    for _ in range(200):
        body = (await client.get(f"/v1/jobs/{job_id}", headers=headers)).json()
        if body["status"] in ("completed", "failed", "cancelled"):
            return body
        await asyncio.sleep(0.01)
    raise AssertionError("job did not finish")


def _events(text: str) -> list[tuple[str, str]]:
    """(id, event type) of each SSE event."""
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "id" in fields:
            out.append((fields["id"], fields["event"]))
    return out


async def test_submit_poll_and_response() -> None:
    async with harness() as h:
        r = await h.client.post("/v1/jobs", json=CHAT)
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["object"] == "job" and job["status"] == "queued" and job["id"].startswith("job-")
        final = await _wait_final(h.client, job["id"])
        assert final["status"] == "completed" and final["attempts"] == 1
        response = final["response"]
        assert response["object"] == "chat.completion"
        assert response["choices"][0]["message"]["content"] == "Hi 0!"
        assert final["usage"]["completion_tokens"] == 5 and final["error"] is None
        assert h.worker.payloads[0].stream is False  # jobs are polled


async def test_events_replay_and_resume() -> None:
    async with harness() as h:
        job_id = (await h.client.post("/v1/jobs", json=CHAT)).json()["id"]
        await _wait_final(h.client, job_id)
        full = await h.client.get(f"/v1/jobs/{job_id}/events")
        assert full.status_code == 200
        events = _events(full.text)
        assert [t for _, t in events] == ["started"] + ["delta"] * 5 + ["done"]
        assert 'data: {"v":1,"type":"done"' in full.text
        resumed = await h.client.get(
            f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": events[2][0]}
        )
        assert _events(resumed.text) == events[3:]  # nothing missing, nothing repeated
        bad = await h.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "x-1"})
        assert bad.status_code == 400


async def test_events_live_while_running() -> None:
    async with harness() as h:
        h.worker.step_s = 0.02
        job_id = (await h.client.post("/v1/jobs", json=CHAT)).json()["id"]
        r = await h.client.get(f"/v1/jobs/{job_id}/events")
        assert [t for _, t in _events(r.text)][-1] == "done"


async def test_cancel_queued_job() -> None:
    async with harness(start_worker=False) as h:
        job_id = (await h.client.post("/v1/jobs", json=CHAT)).json()["id"]
        assert await h.redis.zscore(h.keys.queue("test-model"), job_id) is not None
        r = await h.client.delete(f"/v1/jobs/{job_id}")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "cancelled" and body["error"]["code"] == "job_cancelled"
        assert await h.redis.zscore(h.keys.queue("test-model"), job_id) is None
        events = await h.client.get(f"/v1/jobs/{job_id}/events")
        assert [t for _, t in _events(events.text)] == ["error"]
        again = await h.client.delete(f"/v1/jobs/{job_id}")
        assert again.json()["status"] == "cancelled"


async def test_unknown_and_foreign_jobs_are_404() -> None:
    async with harness(api_keys=["key-a", "key-b"]) as h:
        a, b = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}
        assert (await h.client.get("/v1/jobs/job-nope", headers=a)).status_code == 404
        job_id = (await h.client.post("/v1/jobs", json=CHAT, headers=a)).json()["id"]
        for method in ("GET", "DELETE"):
            r = await h.client.request(method, f"/v1/jobs/{job_id}", headers=b)
            assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
        assert (await h.client.get(f"/v1/jobs/{job_id}/events", headers=b)).status_code == 404
        assert (await _wait_final(h.client, job_id, a))["status"] == "completed"


async def test_submit_wakes_the_workers() -> None:
    async with harness() as h:
        pubsub = h.redis.pubsub()
        await pubsub.subscribe(h.keys.wake_channel)
        await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
        job_id = (await h.client.post("/v1/jobs", json=CHAT)).json()["id"]
        message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2.0)
        await pubsub.aclose()
        assert message is not None and message["data"].decode() == job_id

"""`Idempotency-Key` on `POST /v1/jobs`, on the real Redis: one job per key and body, 409 for
another body, claims per API key, released when the submission is refused, kept with the job."""

from __future__ import annotations

import asyncio
import json

import pytest

from api.jobs import idempotency
from shared.contracts import QUEUED_GRACE_S
from tests.unit.api_harness import harness

pytestmark = pytest.mark.redis

KEY_A, KEY_B = "sk-ladle-alpha-0123456789", "sk-ladle-bravo-9876543210"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
JOB = {"url": "/v1/completions", "body": {"model": "test-model", "prompt": "Hello"}}


def _idem(key: str, auth: dict | None = None) -> dict[str, str]:
    return {**(auth or {}), "Idempotency-Key": key, "Content-Type": "application/json"}


async def test_same_key_and_body_give_the_first_job_and_another_body_409() -> None:
    async with harness(start_worker=False) as h:
        first = await h.client.post("/v1/jobs", json=JOB, headers=_idem("order-1"))
        assert first.status_code == 202 and "idempotent-replayed" not in first.headers
        same = json.dumps({"body": {"prompt": "Hello", "model": "test-model"}, "url": JOB["url"]})
        again = await h.client.post("/v1/jobs", content=same, headers=_idem("order-1"))
        assert again.status_code == 202 and again.headers["idempotent-replayed"] == "true"
        assert again.json()["id"] == first.json()["id"]
        other = {"url": JOB["url"], "body": {**JOB["body"], "max_tokens": 3}}
        conflict = await h.client.post("/v1/jobs", json=other, headers=_idem("order-1"))
        assert conflict.status_code == 409
        assert conflict.json()["error"] == {
            "message": "Idempotency-Key 'order-1' was already used with a different request body",
            "type": "conflict_error",
            "param": "Idempotency-Key",
            "code": "idempotency_key_reused",
        }
        assert await h.redis.zcard(h.keys.queue("test-model")) == 1
        claim = [k async for k in h.redis.scan_iter(match=f"{h.keys.prefix}:idem:*")]
        ttl = await h.redis.ttl(claim[0])
        assert len(claim) == 1 and QUEUED_GRACE_S < ttl <= QUEUED_GRACE_S + h.settings.job_ttl_s


async def test_a_replay_shows_the_job_as_it_is_now() -> None:
    async with harness() as h:
        first = await h.client.post("/v1/jobs", json=JOB, headers=_idem("k"))
        job_id = first.json()["id"]
        for _ in range(200):
            if (await h.client.get(f"/v1/jobs/{job_id}")).json()["status"] == "completed":
                break
            await asyncio.sleep(0.02)
        again = await h.client.post("/v1/jobs", json=JOB, headers=_idem("k"))
        assert again.json()["id"] == job_id and again.json()["status"] == "completed"
        assert len(h.worker.payloads) == 1  # the work was done once


async def test_concurrent_duplicates_make_one_job() -> None:
    async with harness(start_worker=False) as h:
        answers = await asyncio.gather(
            *(h.client.post("/v1/jobs", json=JOB, headers=_idem("burst")) for _ in range(6))
        )
        assert {a.status_code for a in answers} == {202}
        assert len({a.json()["id"] for a in answers}) == 1
        assert sum(a.headers.get("idempotent-replayed") == "true" for a in answers) == 5
        assert await h.redis.zcard(h.keys.queue("test-model")) == 1


async def test_claims_belong_to_one_api_key() -> None:
    async with harness(start_worker=False, api_keys=[KEY_A, KEY_B]) as h:
        a = await h.client.post("/v1/jobs", json=JOB, headers=_idem("same", A))
        b = await h.client.post("/v1/jobs", json=JOB, headers=_idem("same", B))
        assert a.status_code == b.status_code == 202 and a.json()["id"] != b.json()["id"]


async def test_a_refused_submission_frees_the_key() -> None:
    async with harness(start_worker=False, max_queue_depth=1) as h:
        held = await h.client.post("/v1/jobs", json=JOB, headers=_idem("first"))
        refused = await h.client.post("/v1/jobs", json=JOB, headers=_idem("second"))
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        await h.client.delete(f"/v1/jobs/{held.json()['id']}")
        retried = await h.client.post("/v1/jobs", json=JOB, headers=_idem("second"))
        assert retried.status_code == 202 and "idempotent-replayed" not in retried.headers


async def test_a_claim_whose_job_is_gone_is_taken_over(monkeypatch: pytest.MonkeyPatch) -> None:
    async with harness(start_worker=False) as h:
        first = (await h.client.post("/v1/jobs", json=JOB, headers=_idem("k"))).json()["id"]
        await h.redis.delete(h.keys.job(first))  # expired (or its API died before writing it)
        monkeypatch.setattr(idempotency, "STALE_CLAIM_S", 0.0)
        second = await h.client.post("/v1/jobs", json=JOB, headers=_idem("k"))
        assert second.status_code == 202 and second.json()["id"] != first


@pytest.mark.parametrize("key", ["", "x" * 256, "has space", "tab\tkey"])
async def test_bad_keys_are_400(key: str) -> None:
    async with harness(start_worker=False) as h:
        r = await h.client.post("/v1/jobs", json=JOB, headers=_idem(key))
        assert r.status_code == 400 and r.json()["error"]["param"] == "Idempotency-Key"
        assert await h.redis.zcard(h.keys.queue("test-model")) == 0

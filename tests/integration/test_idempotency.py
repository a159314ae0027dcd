"""`Idempotency-Key` through the real API and worker processes: a client that retries its
submission (it lost the first answer) gets the one job, completed once."""

from __future__ import annotations

from tests.integration.faults import body, model_id, poll, records
from tests.support.harness import Service


def test_a_retried_submission_runs_once(service: Service) -> None:
    job = {"url": "/v1/completions", "body": body(8, model=model_id(service))}
    headers = {"Idempotency-Key": "retry-me-7"}
    with service.client() as http:
        first = http.post("/v1/jobs", json=job, headers=headers)
        done = poll(http, first.json()["id"])
        again = http.post("/v1/jobs", json=job, headers=headers)
        changed = {**job, "body": {**job["body"], "max_tokens": 9}}
        conflict = http.post("/v1/jobs", json=changed, headers=headers)
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"] and again.json()["status"] == "completed"
    assert again.json()["response"] == done["response"] and done["attempts"] == 1
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "idempotency_key_reused"
    mine = [r for r in records(service).values() if r["id"] == first.json()["id"]]
    assert len(mine) == 1 and mine[0]["status"] == "completed"

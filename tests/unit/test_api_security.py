"""Security: keys on every route but /health and /ready, keys never logged, job ownership,
unguessable job ids, per-key and body limits, Redis URLs with passwords and TLS."""

from __future__ import annotations

import base64
import logging
import re

import pytest
from redis.asyncio.connection import SSLConnection

from api.app import make_redis
from api.jobs.store import new_job_id
from shared.config import Settings
from shared.keys import Keys
from shared.logging import JsonFormatter
from tests.unit.api_harness import harness
from worker.redis_settings import arq_redis_settings

PROMPT = {"model": "test-model", "prompt": "Hello"}
JOB = {"url": "/v1/completions", "body": PROMPT}
KEY_A, KEY_B = "sk-ladle-alpha-0123456789", "sk-ladle-bravo-9876543210"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
OPEN_ROUTES = {("GET", "/health"), ("GET", "/ready")}


def _routes(app) -> list[tuple[str, str]]:
    paths = app.openapi()["paths"]
    return [(m.upper(), p.replace("{job_id}", "job-x")) for p, ops in paths.items() for m in ops]


@pytest.mark.redis
async def test_every_route_but_health_and_ready_needs_a_key() -> None:
    async with harness(api_keys=[KEY_A]) as h:
        routes = _routes(h.app)
        assert ("GET", "/metrics") in routes and len(routes) >= 13
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY_A}):
                r = await h.client.request(method, path, json={}, headers=headers)
                if (method, path) in OPEN_ROUTES:
                    assert r.status_code == 200, (method, path)
                    continue
                assert r.status_code == 401, (method, path, headers, r.text)
                assert r.headers["www-authenticate"] == "Bearer"
                assert r.json()["error"]["code"] == "invalid_api_key"
        r = await h.client.get("/metrics", headers=A)
        assert r.status_code == 200 and "llm_requests_total" in r.text
    async with harness() as h:  # no keys configured: everything is open
        assert (await h.client.get("/metrics")).status_code == 200
        assert (await h.client.get("/v1/models")).status_code == 200


@pytest.mark.redis
async def test_keys_are_never_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    async with harness(api_keys=[KEY_A, KEY_B]) as h:
        assert (await h.client.post("/v1/completions", json=PROMPT, headers=A)).status_code == 200
        r = await h.client.post("/v1/chat/completions", json={"messages": []}, headers=B)
        assert r.status_code == 400
        bad = {"Authorization": f"Bearer {KEY_A}x"}
        assert (await h.client.get("/v1/models", headers=bad)).status_code == 401
        job_id = (await h.client.post("/v1/jobs", json=JOB, headers=B)).json()["id"]
        assert (await h.client.get(f"/v1/jobs/{job_id}", headers=A)).status_code == 404
    formatter = JsonFormatter()
    lines = [formatter.format(record) for record in caplog.records]
    assert any('"api_key_id"' in line for line in lines)  # the logs say who, by hash id
    text = "\n".join(lines) + caplog.text
    for key in (KEY_A, KEY_B):
        assert key not in text and key[8:20] not in text


@pytest.mark.redis
async def test_one_key_cannot_read_or_cancel_another_keys_job() -> None:
    async with harness(start_worker=False, api_keys=[KEY_A, KEY_B]) as h:
        job_id = (await h.client.post("/v1/jobs", json=JOB, headers=A)).json()["id"]
        for method, path in (
            ("GET", f"/v1/jobs/{job_id}"),
            ("DELETE", f"/v1/jobs/{job_id}"),
            ("GET", f"/v1/jobs/{job_id}/events"),
        ):
            r = await h.client.request(method, path, headers=B)
            assert r.status_code == 404, (method, path)
            assert r.json()["error"] == {
                "message": f"No job with id '{job_id}'",
                "type": "not_found_error",
                "param": "job_id",
                "code": "job_not_found",
            }
        own = await h.client.get(f"/v1/jobs/{job_id}", headers=A)
        assert own.status_code == 200 and own.json()["status"] == "queued"  # B cancelled nothing
        assert await h.redis.zscore(h.keys.queue("test-model"), job_id) is not None
        assert not await h.redis.exists(h.keys.cancelled(job_id))


@pytest.mark.redis
async def test_per_key_limit_on_unfinished_jobs() -> None:
    async with harness(
        start_worker=False, api_keys=[KEY_A, KEY_B], per_key_max_concurrent_jobs=2
    ) as h:
        ids = [(await h.client.post("/v1/jobs", json=JOB, headers=A)).json()["id"] for _ in "ab"]
        r = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "too_many_jobs"
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert (await h.client.post("/v1/jobs", json=JOB, headers=B)).status_code == 202
        assert (await h.client.delete(f"/v1/jobs/{ids[0]}", headers=A)).status_code == 200
        assert (await h.client.post("/v1/jobs", json=JOB, headers=A)).status_code == 202
        # the refused job was never queued
        assert await h.redis.zcard(h.keys.queue("test-model")) == 3


@pytest.mark.redis
async def test_body_limit_applies_before_auth_and_parsing() -> None:
    async with harness(start_worker=False, api_keys=[KEY_A], max_request_body_bytes=4096) as h:
        big = {**PROMPT, "prompt": "x" * 5000}
        for headers in ({}, A):
            r = await h.client.post("/v1/completions", json=big, headers=headers)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_job_ids_are_unguessable() -> None:
    ids = [new_job_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for job_id in ids[:200]:
        assert re.fullmatch(r"job-[A-Za-z0-9_-]{22}", job_id), job_id
        raw = base64.urlsafe_b64decode(job_id.removeprefix("job-") + "==")
        assert len(raw) * 8 >= 128  # 16 bytes from `secrets`


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "redis://:s3cret@10.0.0.5:6379/2",
            {"host": "10.0.0.5", "port": 6379, "database": 2, "password": "s3cret", "ssl": False},
        ),
        (
            "rediss://ladle:p%40ss%2Fw0rd@redis.example.com:6380/1",
            {
                "host": "redis.example.com",
                "port": 6380,
                "database": 1,
                "username": "ladle",
                "password": "p@ss/w0rd",
                "ssl": True,
            },
        ),
        (
            "rediss://:pw@cache.internal?ssl_cert_reqs=none&ssl_ca_certs=/etc/ca.pem",
            {
                "port": 6379,
                "password": "pw",
                "ssl": True,
                "ssl_cert_reqs": "none",
                "ssl_ca_certs": "/etc/ca.pem",
            },
        ),
        ("unix:///run/redis.sock?db=3", {"unix_socket_path": "/run/redis.sock", "database": 3}),
    ],
)
def test_redis_urls_with_password_and_tls(url: str, expected: dict) -> None:
    worker_side = arq_redis_settings(url)  # what worker/process.py connects with
    for name, value in expected.items():
        assert getattr(worker_side, name) == value, name
    api_pool = make_redis(Settings(redis_url=url, _env_file=None), Keys("t")).connection_pool
    kwargs = api_pool.connection_kwargs  # what the API connects with
    assert kwargs.get("password") == expected.get("password")
    assert kwargs.get("username") == expected.get("username")
    assert kwargs.get("db", 0) == expected.get("database", 0)
    assert (api_pool.connection_class is SSLConnection) == expected.get("ssl", False)


def test_redis_url_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_REDIS_URL", "rediss://:hunter2@db.example:6390/4")
    settings = Settings(_env_file=None)
    worker_side = arq_redis_settings(settings.redis_url)
    assert (worker_side.host, worker_side.port, worker_side.database) == ("db.example", 6390, 4)
    assert worker_side.ssl and worker_side.password == "hunter2"

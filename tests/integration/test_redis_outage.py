"""Redis goes away and comes back: the API answers 503 meanwhile, nothing crashes, both sides
reconnect, and every job accepted before the outage finishes or fails with a reason.

The service runs on its own `redis-server` (a spare port, a temp dir), stopped with SIGTERM
and started again on the same port. Without persistence the restart loses everything: jobs
already on a worker finish (the worker puts their records back and retries its writes); a job
still queued is gone, and its waiting client gets a 503 `job_lost`. With AOF the queue and
records survive: a job queued while no worker ran completes once one starts.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.integration.faults import (
    Call,
    body,
    expected_text,
    model_id,
    poll,
    records,
    wait_ready,
    wait_records,
)
from tests.support.harness import RedisServer, Service, start_service


@dataclass
class Setup:
    service: Service
    redis: RedisServer
    model_dir: Path


@pytest.fixture(scope="module")
def setup(tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    svc = start_service(
        tiny_service_model, tmp_path_factory.mktemp("logs"), num_workers=1, redis_url=server.url
    )
    yield Setup(svc, server, tiny_service_model)
    for proc in svc.workers:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
    svc.stop()
    server.stop()


def _assert_unavailable(svc: Service, model: str) -> None:
    with svc.client() as http:
        time.sleep(0.6)  # past the API's worker-list cache
        for url, payload in (
            ("/v1/completions", body(5, model=model)),
            ("/v1/jobs", {"url": "/v1/completions", "body": body(5, model=model)}),
        ):
            response = http.post(url, json=payload)
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "redis_unavailable"
            assert response.json()["error"]["type"] == "service_unavailable"
        ready = http.get("/ready")
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "redis_unavailable"
        assert http.get("/health").status_code == 200


def test_redis_restart_without_persistence(setup: Setup) -> None:
    svc, server = setup.service, setup.redis
    expected = expected_text(setup.model_dir, 400)
    model = model_id(svc)
    running = Call(svc, body(400, stream=True, model=model)).start()
    assert running.headers_seen.wait(30)
    svc.signal_worker(0, signal.SIGSTOP)  # holds the job mid-generation; takes no more
    with svc.client() as http:
        created = http.post(
            "/v1/jobs", json={"url": "/v1/completions", "body": body(20, model=model)}
        )
        assert created.status_code == 202, created.text
        polled = created.json()["id"]
        queued = Call(svc, body(5, model=model)).start()
        wait_records(svc, lambda rs: sum(r["status"] == "queued" for r in rs.values()) == 2)
        server.stop()
        _assert_unavailable(svc, model)
        svc.signal_worker(0, signal.SIGCONT)  # generates on, and finishes, while Redis is away
        time.sleep(1.5)
        assert svc.is_alive()
        server.start()
        restarted = time.monotonic()

        running.join()
        assert running.error is None
        assert running.text == expected and running.saw_done  # one complete stream
        job = poll(http, running.job_id, timeout=30)  # its final write waited for Redis
        assert job["status"] == "completed"
        assert job["response"]["choices"][0]["text"] == expected
        queued.join()
        assert queued.status == 503  # queued when Redis lost everything: told, not left hanging
        assert queued.json is not None and queued.json["error"]["code"] == "job_lost"
        assert http.get(f"/v1/jobs/{polled}").status_code == 404  # its record is gone too

        answer = _complete_soon(http, model, restarted + 20)
        assert answer["usage"]["completion_tokens"] == 5
    assert svc.is_alive()


def _complete_soon(http, model: str, deadline: float) -> dict:  # noqa: ANN001
    """A new request succeeds once the worker is back (503 until its heartbeat returns)."""
    while True:
        response = http.post("/v1/completions", json=body(5, model=model))
        if response.status_code == 200 or time.monotonic() > deadline:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.2)


def test_aof_keeps_a_queued_job_across_a_redis_restart(setup: Setup) -> None:
    svc, server = setup.service, setup.redis
    server.stop()
    server.aof = True  # appendonly yes, appendfsync everysec
    server.start()
    wait_ready(svc)
    model = model_id(svc)
    with svc.client() as http:
        svc.signal_worker(0, signal.SIGSTOP)  # no worker takes the job...
        created = http.post(
            "/v1/jobs", json={"url": "/v1/completions", "body": body(12, model=model)}
        )
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        svc.signal_worker(0, signal.SIGKILL)  # ...and none is left
        svc.workers[0].wait(timeout=10)
        server.stop()  # SIGTERM flushes the AOF
        server.start()
        job = http.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "queued"
        assert records(svc)[job_id]["status"] == "queued"
        svc.start_worker()
        job = poll(http, job_id, timeout=60)
    assert job["status"] == "completed"
    assert job["response"]["choices"][0]["text"] == expected_text(setup.model_dir, 12)

"""Redis at `maxmemory` (noeviction: writes refused). New submissions get 503
`redis_out_of_memory` and leave nothing behind; a stream already running waits (the worker's
writes retry) and completes once memory frees; new requests work again.

Redis is the test's own `redis-server`; 20 MB of filler keys, then `maxmemory` set below what
is used, stand in for a Redis that filled up; deleting the filler frees it.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.integration.faults import Call, body, expected_text, model_id, poll
from tests.support.harness import RedisServer, Service, start_service, wait_until

FILLER_KEYS, FILLER_BYTES = 200, 100_000


@pytest.fixture(scope="module")
def full_redis(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, RedisServer]]:
    server = RedisServer(tmp_path_factory.mktemp("redis-full"))
    server.start()
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("logs"),
        redis_url=server.url,
        worker_ttl_s=15,  # the heartbeat cannot write while Redis is full: keep the worker
    )
    yield svc, server
    svc.stop()
    server.stop()


def _fill(client: redis.Redis) -> None:
    with client.pipeline(transaction=False) as pipe:
        for i in range(FILLER_KEYS):
            pipe.set(f"filler:{i}", b"x" * FILLER_BYTES)
        pipe.execute()
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", used - 1_000_000)


def _wait_log(path: Path, text: str, timeout: float = 30.0) -> None:
    wait_until(lambda: text in path.read_text(errors="replace"), timeout, f"{text!r} in {path}")


def _keys(client: redis.Redis, svc: Service) -> set[bytes]:
    return set(client.scan_iter(f"{svc.prefix}:*")) | set(client.scan_iter("arq:*"))


def test_full_redis_refuses_cleanly_and_recovers(
    full_redis: tuple[Service, RedisServer], tiny_service_model: Path
) -> None:
    svc, server = full_redis
    client = redis.Redis.from_url(server.url)
    model = model_id(svc)
    expected = expected_text(tiny_service_model, 400)
    running = Call(svc, body(400, stream=True, model=model)).start()
    assert running.headers_seen.wait(30)
    svc.signal_worker(0, signal.SIGSTOP)  # mid-generation until Redis is full
    _fill(client)
    before = _keys(client, svc)
    svc.signal_worker(0, signal.SIGCONT)
    _wait_log(svc.log_dir / "worker0.log", "publishing events failed")  # it hit the wall
    job = {"url": "/v1/completions", "body": body(5, model=model)}
    with svc.client() as http:
        answers = [
            http.post("/v1/completions", json=body(5, model=model)),
            http.post("/v1/jobs", json=job),
            http.post("/v1/jobs", json=job, headers={"Idempotency-Key": "full-1"}),
        ]
        for answer in answers:
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"]["code"] == "redis_out_of_memory"
            assert answer.json()["error"]["type"] == "service_unavailable"
            assert answer.headers["retry-after"] == "5"
        assert http.get("/health").status_code == 200
        assert _keys(client, svc) <= before  # nothing half-written
        client.delete(*(f"filler:{i}" for i in range(FILLER_KEYS)))  # memory frees
        running.join(timeout=120)
        assert running.error is None and running.saw_done
        assert running.text == expected  # no token lost while writes were refused
        assert poll(http, running.job_id)["status"] == "completed"
        again = http.post("/v1/jobs", json=job, headers={"Idempotency-Key": "full-1"})
        assert again.status_code == 202, again.text
        assert poll(http, again.json()["id"])["status"] == "completed"
        assert http.post("/v1/completions", json=body(5, model=model)).status_code == 200
    assert svc.is_alive()

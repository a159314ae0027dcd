"""`ladle up` heals: SIGKILL the worker running a job; the job completes on the other worker,
the killed worker is back (heartbeating, new pid) within 30 s, and the API answers throughout.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.up import UpProcess
from tests.integration.faults import body, poll, wait_records
from tests.support.harness import ROOT, TEST_REDIS_URL, cleanup_keys, spare_port

MAX_TOKENS = 400


@pytest.fixture
def up(tiny_service_model: Path, tmp_path: Path) -> Iterator[UpProcess]:
    prefix = f"ladletest-{os.urandom(4).hex()}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LLM_REDIS_URL": TEST_REDIS_URL,
        "LLM_KEY_PREFIX": prefix,
        "LLM_MODEL_NAME": str(tiny_service_model),
        "LLM_DTYPE": "float32",
        "LLM_DEVICE": "cpu",
        "LLM_KV_CACHE_SIZE_MB": "8",
        "LLM_NUM_THREADS": "1",
        "LLM_WORKER_METRICS_PORT": "0",
        "LLM_SUPERVISOR_METRICS_PORT": str(spare_port()),
        "LLM_HEARTBEAT_INTERVAL_S": "0.2",
        "LLM_WORKER_TTL_S": "2",
        "LLM_SHUTDOWN_TIMEOUT_S": "5",
    }
    process = UpProcess(env, spare_port(), 2, tmp_path / "up.log")
    process.start()
    yield process
    process.stop()
    cleanup_keys(prefix)


class Watch:
    """GET /health every 50 ms in a thread; every failure is kept."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.failures: list[str] = []
        self.num_ok = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=5) as http:
            while not self._stop.wait(0.05):
                try:
                    status = http.get("/health").status_code
                    self.num_ok += status == 200
                    if status != 200:
                        self.failures.append(str(status))
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))


def _worker_pid(up: UpProcess, http: httpx.Client, worker_id: str) -> int | None:
    return next((w["pid"] for w in up.live_workers(http) if w["id"] == worker_id), None)


def test_sigkill_of_the_busy_worker_heals(up: UpProcess) -> None:
    with httpx.Client(base_url=up.base_url, timeout=30) as http:
        up.wait_ready(http, num_workers=2)
        model = http.get("/v1/models").json()["data"][0]["id"]
        with Watch(up.base_url) as watch:
            created = http.post(
                "/v1/jobs", json={"url": "/v1/completions", "body": body(MAX_TOKENS, model=model)}
            )
            assert created.status_code == 202, created.text
            job_id = created.json()["id"]
            running = wait_records(
                _ServiceView(up), lambda rs: rs.get(job_id, {}).get("status") == "in_progress"
            )
            victim = running[job_id]["worker_id"]
            old_pid = _worker_pid(up, http, victim)
            assert old_pid is not None
            os.kill(old_pid, signal.SIGKILL)
            killed_at = time.monotonic()
            job = poll(http, job_id, timeout=60)
            back = _wait_new_pid(up, http, victim, old_pid, killed_at + 30)
        assert job["status"] == "completed", job
        assert job["attempts"] == 2 and job["worker_id"] != victim
        assert job["usage"]["completion_tokens"] == MAX_TOKENS
        assert back - killed_at < 30
        assert watch.failures == [] and watch.num_ok > 10
        name = f"worker-{victim.rsplit('-', 1)[-1]}"
        ready = http.get("/ready").json()
        restarts = {p["name"]: p["restarts"] for p in ready["processes"]}
        assert restarts == {"api": 0, "worker-0": 0, "worker-1": 0, name: 1}
        assert ready["warnings"] == []
        metrics = httpx.get(
            f"http://127.0.0.1:{up.env['LLM_SUPERVISOR_METRICS_PORT']}/metrics"
        ).text
        assert f'llm_supervisor_restarts_total{{child="{name}"}} 1.0' in metrics
    assert up.stop() == 0


def _wait_new_pid(
    up: UpProcess, http: httpx.Client, worker_id: str, old_pid: int, deadline: float
) -> float:
    """When the worker id heartbeats again from a new process."""
    while time.monotonic() < deadline:
        pid = _worker_pid(up, http, worker_id)
        if pid is not None and pid != old_pid:
            return time.monotonic()
        time.sleep(0.1)
    raise AssertionError(f"{worker_id} not back within 30 s: {up.live_workers(http)}")


class _ServiceView:
    """What `faults.records` needs of a service: where its job records are."""

    def __init__(self, up: UpProcess) -> None:
        self.redis_url = up.redis_url
        self.prefix = up.env["LLM_KEY_PREFIX"]

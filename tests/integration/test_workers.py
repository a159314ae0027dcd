"""Several workers: load spreads, SIGTERM drains, kill -9 restarts jobs elsewhere."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_service import PROMPT, _poll
from tests.support.engines import make_engine
from tests.support.harness import Service, start_service
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM


@pytest.fixture
def two_workers(tiny_service_model: Path, tmp_path: Path) -> Iterator[Service]:
    # Small batches so that 20 jobs cannot all sit on one worker.
    svc = start_service(
        tiny_service_model,
        tmp_path / "logs",
        num_workers=2,
        max_batch_size=4,
        worker_max_queued=2,
        shutdown_timeout_s=1,
    )
    yield svc
    svc.stop()


def _submit(http: httpx.Client, max_tokens: int, prompt: str = PROMPT) -> str:
    body = {
        "model": _model(http),
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    response = http.post("/v1/jobs", json={"url": "/v1/completions", "body": body})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _model(http: httpx.Client) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def test_jobs_spread_over_workers_and_survive_sigterm(two_workers: Service) -> None:
    with two_workers.client() as http:
        job_ids = [_submit(http, max_tokens=150) for _ in range(20)]
        time.sleep(0.5)
        two_workers.signal_worker(0, signal.SIGTERM)  # mid-load: drains, hands the rest back
        jobs = [_poll(http, job_id, timeout=120) for job_id in job_ids]
    assert [job["status"] for job in jobs] == ["completed"] * 20
    assert {job["worker_id"] for job in jobs} == {
        two_workers.worker_id(0),
        two_workers.worker_id(1),
    }
    texts = {job["response"]["choices"][0]["text"] for job in jobs}
    assert len(texts) == 1  # same greedy request, same answer, whichever worker ran it
    assert two_workers.workers[0].wait(timeout=30) == 0


def test_kill_9_restarts_the_job_on_another_worker(
    two_workers: Service, tiny_service_model: Path
) -> None:
    expected = (
        LLM(engine=make_engine(tiny_service_model))
        .generate(PROMPT, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))[0]
        .outputs[0]
    )
    stream_result: dict = {"started": threading.Event()}
    streamer = threading.Thread(
        target=_stream_completion, args=(two_workers, stream_result), daemon=True
    )
    streamer.start()
    assert stream_result["started"].wait(30), "the streaming request never got headers"
    with two_workers.client() as http:
        job_id = stream_result["job_id"]
        victim = _wait_running_worker(http, job_id)
        _wait_tokens(stream_result, 3)  # mid-stream, however fast the machine
        two_workers.signal_worker(victim, signal.SIGKILL)
        job = _poll(http, job_id, timeout=60)
        streamer.join(timeout=60)
    assert job["status"] == "completed"
    assert job["attempts"] == 2
    assert job["worker_id"] == two_workers.worker_id(1 - victim)
    assert job["response"]["choices"][0]["text"] == expected.text
    assert "error" not in stream_result
    assert stream_result.get("text") == expected.text  # one consistent stream


def _wait_running_worker(http: httpx.Client, job_id: str) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] == "in_progress" and job.get("worker_id"):
            return int(job["worker_id"].rsplit("-w", 1)[1])
        time.sleep(0.02)
    raise AssertionError("job never started")


def _wait_tokens(result: dict, count: int) -> None:
    deadline = time.monotonic() + 10
    while len(result["chunks"]) < count:
        assert time.monotonic() < deadline, "the stream never got its first tokens"
        time.sleep(0.001)


def _stream_completion(service: Service, result: dict) -> None:
    """A streaming client of the same request, running through the crash."""
    body = {
        "model": "",
        "prompt": PROMPT,
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=service.base_url, timeout=60) as http:
        body["model"] = _model(http)
        text = result["chunks"] = []
        with http.stream("POST", "/v1/completions", json=body) as response:
            result["job_id"] = response.headers["X-Job-Id"]
            result["started"].set()
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["error"] = chunk["error"]
                        return
                    text.extend(c["text"] for c in chunk.get("choices", []))
        result["text"] = "".join(text)

"""The service end to end: real API and worker processes on the real Redis."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.engines import make_engine
from tests.support.harness import Service
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM

PROMPT = "w5 w17 w99 w42 w7 w128 w64"
MESSAGES = [{"role": "user", "content": "w10 w11 w12 w13"}]


@pytest.fixture(scope="module")
def offline(tiny_service_model: Path) -> LLM:
    return LLM(engine=make_engine(tiny_service_model))


def client_for(service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{service.base_url}/v1", api_key="unused", max_retries=0)


def model_id(service: Service) -> str:
    return client_for(service).models.list().data[0].id


def test_openai_client_completions_equal_the_offline_engine(service: Service, offline: LLM) -> None:
    client = client_for(service)
    model = model_id(service)
    expected = offline.generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    completion = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].text == expected.text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.prompt_tokens == 7

    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_openai_client_chat_stream_and_not(service: Service, offline: LLM) -> None:
    client = client_for(service)
    model = model_id(service)
    expected = offline.chat(
        MESSAGES, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0]
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == expected.text
    assert chat.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(deltas) == expected.text


def test_job_api_submit_poll_replay_and_resume(service: Service) -> None:
    with service.client() as http:
        body = {
            "model": model_id(service),
            "prompt": PROMPT,
            "max_tokens": 20,
            "temperature": 0,
            "ignore_eos": True,
        }
        created = http.post("/v1/jobs", json={"url": "/v1/completions", "body": body})
        assert created.status_code == 202
        job_id = created.json()["id"]
        assert created.json()["status"] in ("queued", "in_progress")
        job = _poll(http, job_id)
        assert job["status"] == "completed"
        assert job["response"]["object"] == "text_completion"
        assert job["response"]["usage"]["completion_tokens"] == 20

        events = _sse(http, f"/v1/jobs/{job_id}/events")
        kinds = [e["event"] for e in events]
        assert kinds[0] == "started" and kinds[-1] == "done"
        assert kinds.count("delta") == 20
        ids = [e["id"] for e in events]
        assert len(set(ids)) == len(ids)

        resumed = _sse(http, f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": ids[5]})
        assert [e["id"] for e in resumed] == ids[6:]
        text = "".join(
            json.loads(e["data"]).get("text", "") for e in events if e["event"] == "delta"
        )
        assert text == job["response"]["choices"][0]["text"]


def test_delete_cancels_a_running_job_and_frees_its_blocks(service: Service) -> None:
    with service.client() as http:
        body = {"model": model_id(service), "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
        job_id = http.post("/v1/jobs", json={"url": "/v1/completions", "body": body}).json()["id"]
        _wait_status(http, job_id, "in_progress")
        cancelled = http.delete(f"/v1/jobs/{job_id}")
        assert cancelled.status_code == 200
        assert service.wait_kv_free(http, timeout=1.0) < 1.0
        job = _poll(http, job_id)
        assert job["status"] == "cancelled"


def test_streaming_client_that_disconnects_frees_its_blocks(service: Service) -> None:
    with service.client() as http:
        body = {
            "model": model_id(service),
            "prompt": PROMPT,
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
        # The connection is closed here, mid-stream.
        assert service.wait_kv_free(http, timeout=1.5) < 1.5


def test_worker_reported_context_error_is_a_400(service: Service) -> None:
    with service.client() as http:
        body = {"model": model_id(service), "prompt": "w5 " * 600, "max_tokens": 4}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "maximum context length is 512" in error["message"]


def _poll(http: httpx.Client, job_id: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} not final after {timeout} s")


def _wait_status(http: httpx.Client, job_id: str, status: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while http.get(f"/v1/jobs/{job_id}").json()["status"] != status:
        assert time.monotonic() < deadline, f"job {job_id} never reached {status}"
        time.sleep(0.02)


def _sse(http: httpx.Client, path: str, headers: dict | None = None) -> list[dict]:
    """Read a finite SSE response into a list of {id, event, data} dicts."""
    events, current = [], {}
    with http.stream("GET", path, headers=headers or {}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line:
                if current:
                    events.append(current)
                current = {}
                continue
            name, _, value = line.partition(": ")
            if name in ("id", "event", "data"):
                current[name] = value
    if current:
        events.append(current)
    return events


def test_a_worker_runs_more_jobs_at_once_than_it_keeps_queued(service: Service) -> None:
    """arq lists running jobs with queued ones; admission must not stall at the queue cap."""
    with service.client() as http:
        body = {"model": model_id(service), "prompt": PROMPT, "max_tokens": 480, "ignore_eos": True}
        job_ids = [
            http.post("/v1/jobs", json={"url": "/v1/completions", "body": body}).json()["id"]
            for _ in range(12)
        ]
        most_running = 0
        deadline = time.monotonic() + 20
        while most_running < 12 and time.monotonic() < deadline:
            workers = service.live_workers(http)
            most_running = max([most_running] + [w["running"] for w in workers])
            time.sleep(0.02)
        for job_id in job_ids:
            http.delete(f"/v1/jobs/{job_id}")
        service.wait_kv_free(http, timeout=2.0)
    # Before the fix a worker never ran more than LLM_WORKER_MAX_QUEUED (4) jobs at once;
    # the first jobs may finish before the last start on an idle machine.
    assert most_running >= 10

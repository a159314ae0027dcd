"""Helpers for the fault tests: job records read straight from Redis, requests in threads."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx

from shared.redis_url import sync_client
from tests.support.harness import Service

PROMPT = "w5 w17 w99 w42 w7 w128 w64"


def body(max_tokens: int, *, stream: bool = False, model: str = "") -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def model_id(service: Service) -> str:
    with service.client() as http:
        return http.get("/v1/models").json()["data"][0]["id"]


def records(service: Service) -> dict[str, dict]:
    """Every job record of the service, by id, read from Redis."""
    client = sync_client(service.redis_url, socket_timeout=5)
    found = {}
    for key in client.scan_iter(f"{service.prefix}:job:*"):
        raw = client.get(key)
        if raw:
            record = json.loads(raw)
            found[record["id"]] = record
    return found


def wait_records(service: Service, check, timeout: float = 30.0) -> dict[str, dict]:  # noqa: ANN001
    """Poll the records until `check(records)` is true."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = records(service)
        if check(found):
            return found
        time.sleep(0.02)
    raise AssertionError(f"records never matched: {records(service)}")


def poll(http: httpx.Client, job_id: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job.get("status") in ("completed", "failed", "cancelled"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} not final after {timeout} s: {job}")


@dataclass
class Call:
    """One OpenAI request run in a thread: a sync JSON answer, or an SSE stream read through."""

    service: Service
    body: dict
    headers_seen: threading.Event = field(default_factory=threading.Event)
    status: int | None = None
    job_id: str | None = None
    json: dict | None = None
    text: str = ""
    error: dict | None = None
    saw_done: bool = False
    thread: threading.Thread | None = None

    def start(self) -> Call:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float = 60.0) -> Call:
        assert self.thread is not None
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the request never ended"
        return self

    def _run(self) -> None:
        with httpx.Client(base_url=self.service.base_url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=self.body) as response:
                self.status = response.status_code
                self.job_id = response.headers.get("X-Job-Id")
                self.headers_seen.set()
                if not self.body.get("stream") or response.status_code != 200:
                    self.json = json.loads(response.read())
                    return
                for line in response.iter_lines():
                    self._line(line)

    def _line(self, line: str) -> None:
        if line == "data: [DONE]":
            self.saw_done = True
        elif line.startswith("data: "):
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self.error = chunk["error"]
            else:
                self.text += "".join(c["text"] for c in chunk.get("choices", []))


def expected_text(model_dir: object, max_tokens: int) -> str:
    """What the offline engine answers to PROMPT, greedily (what the service must answer)."""
    from tests.support.engines import make_engine
    from worker.engine.core.sampling_params import SamplingParams
    from worker.engine.offline import LLM

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine = make_engine(model_dir)  # type: ignore[arg-type]
    return LLM(engine=engine).generate(PROMPT, params)[0].outputs[0].text


def wait_ready(service: Service, timeout: float = 30.0) -> float:
    """Seconds until /ready says 200."""
    started = time.monotonic()
    with service.client() as http:
        while time.monotonic() - started < timeout:
            try:
                if http.get("/ready").status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"not ready after {timeout} s")


def cancel_while_queued(svc: Service) -> str:
    """Submit a job while the only worker is stopped, cancel it, and return its id."""
    with svc.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    svc.signal_worker(0, signal.SIGSTOP)  # the job stays queued
    try:
        with svc.client() as http:
            job = {"url": "/v1/completions", "body": {"model": model, "prompt": PROMPT}}
            job_id = http.post("/v1/jobs", json=job).json()["id"]
            assert http.delete(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    finally:
        svc.signal_worker(0, signal.SIGCONT)
    return job_id

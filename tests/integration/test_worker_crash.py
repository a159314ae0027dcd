"""kill -9 of workers: a sync request gets one complete answer across a crash, and a job whose
worker dies on every try fails with `worker_lost` (polled and synchronous), never stuck.

Four workers load at once; all but one are paused (SIGSTOP) and each kill hands over to the
next one (SIGCONT), so a crash costs no model load.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.faults import PROMPT, Call, body, model_id, poll, wait_records
from tests.support.engines import make_engine
from tests.support.harness import Service, start_service
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM

MAX_TOKENS = 400


class Relay:
    """One running worker at a time; `kill_active` kills it and wakes the next."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.active = 0
        for index in range(1, len(service.workers)):
            service.signal_worker(index, signal.SIGSTOP)

    def kill_active(self) -> None:
        self.service.signal_worker(self.active, signal.SIGKILL)
        self.service.workers[self.active].wait(timeout=10)
        self.active += 1
        assert self.active < len(self.service.workers), "no spare worker left"
        self.service.signal_worker(self.active, signal.SIGCONT)

    def resume_all(self) -> None:
        for proc in self.service.workers:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="module")
def relay(tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Relay]:
    svc = start_service(
        tiny_service_model, tmp_path_factory.mktemp("logs"), num_workers=4, job_max_tries=2
    )
    workers = Relay(svc)
    yield workers
    workers.resume_all()
    svc.stop()


@pytest.fixture(scope="module")
def expected(tiny_service_model: Path) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(engine=make_engine(tiny_service_model)).generate(PROMPT, params)[0].outputs[0].text


def _running(attempt: int, count: int):  # noqa: ANN202
    def check(records: dict[str, dict]) -> bool:
        running = [
            r for r in records.values() if r["status"] == "in_progress" and r["attempts"] == attempt
        ]
        return len(running) >= count

    return check


def test_sync_request_across_kill_9_gets_one_complete_result(relay: Relay, expected: str) -> None:
    svc = relay.service
    call = Call(svc, body(MAX_TOKENS, model=model_id(svc))).start()
    wait_records(svc, _running(attempt=1, count=1))
    relay.kill_active()
    call.join()
    assert call.status == 200, call.json
    assert call.json is not None
    assert call.json["choices"][0]["text"] == expected
    assert call.json["usage"]["completion_tokens"] == MAX_TOKENS
    (record,) = [r for r in wait_records(svc, lambda rs: True).values() if r["id"] == call.job_id]
    assert record["status"] == "completed" and record["attempts"] == 2


def test_job_fails_with_worker_lost_after_its_last_try(relay: Relay) -> None:
    svc = relay.service
    model = model_id(svc)
    with svc.client() as http:
        created = http.post(
            "/v1/jobs", json={"url": "/v1/completions", "body": body(MAX_TOKENS, model=model)}
        )
        assert created.status_code == 202
        job_id = created.json()["id"]
        sync = Call(svc, body(MAX_TOKENS, model=model)).start()
        for attempt in (1, 2):  # LLM_JOB_MAX_TRIES=2: each try's worker dies
            wait_records(svc, _running(attempt=attempt, count=2))
            relay.kill_active()
        # The next worker finds both jobs out of tries: arq's finish_failed_job fails them.
        job = poll(http, job_id, timeout=30)
        sync.join(timeout=30)
    assert job["status"] == "failed"
    assert job["attempts"] == 2
    assert job["error"]["code"] == "worker_lost"
    assert job["error"]["type"] == "server_error"
    assert "2 attempts" in job["error"]["message"]
    assert sync.status == 500
    assert sync.json is not None and sync.json["error"]["code"] == "worker_lost"

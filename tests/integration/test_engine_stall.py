"""A worker whose engine thread stalls mid-job (a step that does not return) reports itself
`unhealthy` within LLM_ENGINE_STALL_S, takes no work, and hands its job back: another worker
completes it (attempt 2) with the expected text. When the step returns, it is healthy again
and frees its blocks."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.faults import Call, body, expected_text, model_id, wait_records
from tests.support.harness import Service, start_service, wait_until

MAX_TOKENS = 60


@pytest.fixture(scope="module")
def stalling(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, Path]]:
    flag = tmp_path_factory.mktemp("stall") / "stall"
    svc = start_service(tiny_service_model, tmp_path_factory.mktemp("logs"), engine_stall_s=1.0)
    svc.start_worker("tests.integration.stall_worker", {"LADLE_TEST_STALL_FILE": str(flag)})
    svc.wait_ready(2)
    yield svc, flag
    flag.unlink(missing_ok=True)
    svc.signal_worker(0, signal.SIGCONT)
    svc.stop()


def _status(http: httpx.Client, svc: Service, worker_id: str) -> str | None:
    return next((w["status"] for w in svc.live_workers(http) if w["id"] == worker_id), None)


def _wait_status(http: httpx.Client, svc: Service, worker_id: str, status: str) -> None:
    wait_until(lambda: _status(http, svc, worker_id) == status, 30, f"{worker_id} {status}")


def test_a_stalled_engine_hands_its_job_to_another_worker(
    stalling: tuple[Service, Path], tiny_service_model: Path
) -> None:
    svc, flag = stalling
    stuck = svc.worker_id(1)
    model = model_id(svc)
    flag.touch()  # the stall worker's next step hangs
    svc.signal_worker(0, signal.SIGSTOP)  # so the job lands on the stall worker
    call = Call(svc, body(MAX_TOKENS, model=model)).start()
    wait_records(svc, lambda rs: any(r["worker_id"] == stuck for r in rs.values()))
    with svc.client() as http:
        _wait_status(http, svc, stuck, "unhealthy")
        svc.signal_worker(0, signal.SIGCONT)
        call.join(timeout=90)
        assert call.status == 200, call.json
        assert call.json is not None
        assert call.json["choices"][0]["text"] == expected_text(tiny_service_model, MAX_TOKENS)
        job = http.get(f"/v1/jobs/{call.job_id}").json()
        assert job["attempts"] == 2 and job["worker_id"] == svc.worker_id(0)
        assert _status(http, svc, stuck) == "unhealthy"  # the step still hangs
        flag.unlink()
        _wait_status(http, svc, stuck, "ready")
        svc.wait_kv_free(http, timeout=10)  # the handed-back job's blocks are free too
    assert svc.is_alive()

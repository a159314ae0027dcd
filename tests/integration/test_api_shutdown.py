"""SIGTERM to the API under load: open requests finish within LLM_SHUTDOWN_TIMEOUT_S or end
with a clean 503 `server_shutting_down` (an SSE error chunk and [DONE], or the response);
their jobs are not cancelled, run on, and are fetched by id from the next API process."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.faults import Call, body, expected_text, model_id, poll, wait_records
from tests.support.harness import Service, start_service


@pytest.fixture
def service(tiny_service_model: Path, tmp_path: Path) -> Iterator[Service]:
    # One job runs at a time (one more waits in the engine); a paused worker stays listed.
    svc = start_service(
        tiny_service_model,
        tmp_path / "logs",
        num_workers=1,
        shutdown_timeout_s=2,
        worker_ttl_s=10,
        max_batch_size=1,
        worker_max_queued=1,
    )
    yield svc
    for proc in svc.workers:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
    svc.stop()


def test_sigterm_lets_streams_finish_or_end_cleanly_and_loses_no_job(
    service: Service, tiny_service_model: Path
) -> None:
    model = model_id(service)
    service.signal_worker(0, signal.SIGSTOP)  # everything below is queued before it runs
    short = Call(service, body(20, stream=True, model=model)).start()
    wait_records(service, lambda rs: len(rs) == 1)  # first in the queue: runs first
    long = [Call(service, body(400, stream=True, model=model)).start() for _ in range(3)]
    sync = Call(service, body(400, model=model)).start()
    wait_records(service, lambda rs: len(rs) == 5)

    service.api.send_signal(signal.SIGTERM)
    stopping = time.monotonic()
    service.signal_worker(0, signal.SIGCONT)
    short.join(timeout=30)
    # However fast the machine, the rest must outlast the grace: pause the worker again.
    service.signal_worker(0, signal.SIGSTOP)
    for call in [*long, sync]:
        call.join(timeout=30)
    assert service.api.wait(timeout=15) in (0, -signal.SIGTERM)
    service.signal_worker(0, signal.SIGCONT)
    assert time.monotonic() - stopping < 10

    assert short.status == 200 and short.error is None and short.saw_done
    assert short.text == expected_text(tiny_service_model, 20)  # finished during the grace
    expected = expected_text(tiny_service_model, 400)
    ended = 0
    for call in long:
        if call.status == 200:  # headers went out: complete, or an error chunk then [DONE]
            assert call.saw_done
            if call.error is None:
                assert call.text == expected
                continue
            assert expected.startswith(call.text)
            error = call.error
        else:  # still waiting for its first token: the 503 response itself
            assert call.status == 503 and call.json is not None
            error = call.json["error"]
        assert error["code"] == "server_shutting_down"
        assert call.job_id in error["message"]
        ended += 1
    assert sync.status == 503 and sync.json is not None
    assert sync.json["error"]["code"] == "server_shutting_down"
    assert ended >= 2  # at most the job after `short` ran before the pause

    service.start_api()  # the jobs ran on: every one is there, complete, by id
    service.wait_ready(num_workers=1)
    with service.client() as http:
        for call in [short, *long, sync]:
            assert call.job_id is not None
            job = poll(http, call.job_id, timeout=30)
            assert job["status"] == "completed", job
            assert job["response"]["choices"][0]["text"] == (
                short.text if call is short else expected
            )

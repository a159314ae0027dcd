"""A batch survives crashes: 40 lines (chat and text completions, some invalid) on two
workers; one worker is killed with SIGKILL and the API is killed and restarted while the
batch runs. Exactly one output or error line per input line, the errors being exactly the
invalid lines. (`python -m loadtest.batch_chaos` is the 1,000-line version.)"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.test_batches import (
    chat_line,
    completion_line,
    jsonl,
    read_lines,
    wait_final,
)
from tests.support.harness import start_service, wait_until

NUM_LINES = 40


def batch_lines() -> tuple[list[dict], set[str]]:
    """40 lines, every 10th one invalid in some way; returns them and the invalid ids."""
    lines, invalid = [], set()
    for i in range(NUM_LINES):
        make = chat_line if i % 2 else completion_line
        line = make(f"line-{i}", f"tell me about {i}", max_tokens=48, ignore_eos=True)
        if i % 10 == 3:
            line["body"]["temperature"] = 9  # out of range
            invalid.add(line["custom_id"])
        elif i % 10 == 7:
            line["body"]["model"] = "no-such-model"
            invalid.add(line["custom_id"])
        lines.append(line)
    return lines, invalid


def wait_completed_lines(client: openai.OpenAI, batch_id: str, count: int) -> None:
    wait_until(
        lambda: client.batches.retrieve(batch_id).request_counts.completed >= count,
        120,
        f"{count} completed lines",
    )


def wait_health(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the restarted API did not answer")


def test_batch_through_a_worker_kill_and_an_api_restart(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("batch-crash-logs"),
        num_workers=2,
        batch_poll_s=0.2,
        max_batch_size=4,
        batch_reserved_seqs=1,
        job_max_tries=3,
    )
    try:
        client = openai.OpenAI(base_url=svc.base_url + "/v1", api_key="unused", max_retries=0)
        lines, invalid = batch_lines()
        uploaded = client.files.create(file=("crash.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        )
        wait_completed_lines(client, batch.id, 4)
        svc.signal_worker(0, signal.SIGKILL)  # it holds running lines: they go elsewhere
        svc.workers[0].wait(timeout=10)
        wait_completed_lines(client, batch.id, 8)
        assert svc.api is not None
        svc.api.kill()  # mid-batch, possibly mid-collection
        svc.api.wait(timeout=10)
        svc.start_api()
        wait_health(svc.base_url)
        batch = wait_final(client, batch.id, timeout=300)
        outputs = read_lines(client, batch.output_file_id)
        errors = read_lines(client, batch.error_file_id)
    finally:
        svc.stop()
    assert batch.status == "completed", batch
    assert len(outputs) + len(errors) == NUM_LINES
    assert sorted(line["custom_id"] for line in outputs + errors) == sorted(
        line["custom_id"] for line in lines
    )
    assert {e["custom_id"] for e in errors} == invalid
    assert all(o["response"]["status_code"] == 200 for o in outputs)
    assert batch.request_counts.model_dump() == {
        "total": NUM_LINES,
        "completed": NUM_LINES - len(invalid),
        "failed": len(invalid),
    }

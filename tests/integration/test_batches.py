"""The Batch API through the official openai client, unchanged: real API and worker
processes on the real Redis."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.harness import Service, start_service

MODEL_LINES = 6


def chat_line(custom_id: str, text: str, **extra: object) -> dict:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 6, "temperature": 0}
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**body, **extra},
    }


def completion_line(custom_id: str, text: str, **extra: object) -> dict:
    body = {"prompt": text, "max_tokens": 6, "temperature": 0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def wait_final(client: openai.OpenAI, batch_id: str, timeout: float = 180.0):  # noqa: ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} not final after {timeout} s: {batch}")


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.fixture(scope="module")
def batch_service(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    # Two batch lines at a time (4 slots, 2 kept for interactive requests): lines queue up.
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("batch-logs"),
        num_workers=1,
        batch_poll_s=0.2,
        max_batch_size=4,
        batch_reserved_seqs=2,
    )
    yield svc
    svc.stop()


@pytest.fixture
def client(batch_service: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=batch_service.base_url + "/v1", api_key="unused", max_retries=0)


def test_openai_client_batch_round_trip(client: openai.OpenAI) -> None:
    lines = [chat_line(f"chat-{i}", f"hello {i}") for i in range(4)]
    lines += [completion_line(f"text-{i}", f"once upon {i}") for i in range(2)]
    lines += [chat_line("bad-temperature", "hi", temperature=5)]
    lines += [completion_line("bad-model", "hi", model="no-such-model")]
    content = jsonl(lines)
    uploaded = client.files.create(file=("in.jsonl", content), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == (
        "batch",
        len(content),
        "in.jsonl",
    )

    created = client.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "round-trip"},
    )
    assert created.status == "validating" and created.metadata == {"run": "round-trip"}
    batch = wait_final(client, created.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 6, "failed": 2}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    outputs = read_lines(client, batch.output_file_id)
    assert [o["custom_id"] for o in outputs] == [line["custom_id"] for line in lines[:MODEL_LINES]]
    for output, line in zip(outputs, lines, strict=False):
        assert output["error"] is None and output["response"]["status_code"] == 200
        body = output["response"]["body"]
        is_chat = line["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        assert body["usage"]["completion_tokens"] >= 1
    errors = {e["custom_id"]: e for e in read_lines(client, batch.error_file_id)}
    assert set(errors) == {"bad-temperature", "bad-model"}
    bad_temp = errors["bad-temperature"]["response"]
    assert bad_temp["status_code"] == 400
    assert bad_temp["body"]["error"]["param"] == "temperature"
    bad_model = errors["bad-model"]["response"]
    assert (bad_model["status_code"], bad_model["body"]["error"]["code"]) == (
        404,
        "model_not_found",
    )

    # The same request sent directly gives the same answer (greedy).
    direct = client.chat.completions.create(
        model=outputs[0]["response"]["body"]["model"],
        messages=[{"role": "user", "content": "hello 0"}],
        max_tokens=6,
        temperature=0,
    )
    batch_answer = outputs[0]["response"]["body"]["choices"][0]["message"]["content"]
    assert direct.choices[0].message.content == batch_answer

    listed = client.batches.list(limit=5)
    assert listed.data[0].id == batch.id
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert uploaded.id in [f.id for f in client.files.list().data]
    assert client.files.delete(uploaded.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_bad_line_is_a_400_naming_it(client: openai.OpenAI) -> None:
    content = jsonl([chat_line("a", "hi")]) + b'{"custom_id": "b", "method": "POST"\n'
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("bad.jsonl", content), purpose="batch")
    assert "Line 2" in str(info.value)
    duplicate = jsonl([chat_line("same", "a"), chat_line("same", "b")])
    with pytest.raises(openai.BadRequestError, match="Line 2"):
        client.files.create(file=("dup.jsonl", duplicate), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )


def test_cancel_keeps_finished_lines_and_stops_the_rest(client: openai.OpenAI) -> None:
    total = 30
    lines = [
        completion_line(f"c{i}", f"story {i}", max_tokens=100, ignore_eos=True)
        for i in range(total)
    ]
    uploaded = client.files.create(file=("many.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(created.id).request_counts.completed < 1:
        assert time.monotonic() < deadline, "no line finished"
        time.sleep(0.1)
    assert client.batches.cancel(created.id).status == "cancelling"
    batch = wait_final(client, created.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    outputs = read_lines(client, batch.output_file_id)
    errors = read_lines(client, batch.error_file_id)
    assert len(outputs) + len(errors) == total
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len({line["custom_id"] for line in outputs + errors}) == total
    assert 1 <= batch.request_counts.completed == len(outputs) < total
    with pytest.raises(openai.ConflictError):
        _cancel_completed(client)


def _cancel_completed(client: openai.OpenAI) -> None:
    uploaded = client.files.create(
        file=("one.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch"
    )
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_final(client, batch.id)
    client.batches.cancel(batch.id)


def test_idempotency_key_creates_one_batch(client: openai.OpenAI) -> None:
    uploaded = client.files.create(
        file=("idem.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch"
    )
    headers = {"Idempotency-Key": "batch-once-1"}
    args = {"input_file_id": uploaded.id, "completion_window": "24h"}
    first = client.batches.create(endpoint="/v1/chat/completions", extra_headers=headers, **args)
    again = client.batches.with_raw_response.create(
        endpoint="/v1/chat/completions", extra_headers=headers, **args
    )
    assert again.parse().id == first.id and again.headers["Idempotent-Replayed"] == "true"
    with pytest.raises(openai.ConflictError):
        client.batches.create(endpoint="/v1/completions", extra_headers=headers, **args)
    assert wait_final(client, first.id).request_counts.total == 1


def test_ladle_batch_submit_status_and_cancel(batch_service: Service, tmp_path: Path) -> None:
    lines = [chat_line(f"q{i}", f"w{i + 5}") for i in range(3)] + [completion_line("t", "w9")]
    source = tmp_path / "prompts.jsonl"
    source.write_bytes(jsonl(lines))
    base = [sys.executable, "-m", "ladle", "batch", "--base-url", batch_service.base_url]
    done = subprocess.run(
        [*base, "submit", str(source), "--poll", "0.2"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "4/4 (4 ok, 0 failed) completed" in done.stderr  # the progress bar's last state
    outputs = [
        json.loads(line) for line in (tmp_path / "prompts.output.jsonl").read_text().splitlines()
    ]
    assert [o["custom_id"] for o in outputs] == ["q0", "q1", "q2", "t"]
    batch_id = done.stderr.split("batch ", 1)[1].split()[0]
    status = subprocess.run([*base, "status", batch_id], capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["status"] == "completed"
    cancel = subprocess.run([*base, "cancel", batch_id], capture_output=True, text=True, timeout=60)
    assert cancel.returncode != 0 and "409" in cancel.stderr  # a completed batch stays so

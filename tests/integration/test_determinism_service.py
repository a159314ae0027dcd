"""The default model in bf16 through the service, with the official openai client: a greedy
chat request gives the same text streamed, not streamed and as a job, the first time and on
every repeat (its prompt then comes from the prefix cache). The 200-prompt version with
other traffic mixed in is `python -m loadtest.determinism` (docs/benchmarks.md)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.harness import Service, start_service, wait_until

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = (
    "What is the boiling point of water in Celsius?",
    "Name three planets of the solar system.",
    "Write a haiku about soup.",
)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = start_service(
        Path(MODEL),
        tmp_path_factory.mktemp("logs"),
        num_threads=2,
        kv_cache_size_mb=64,
        dtype="auto",
        linear_kernel="native",
        deterministic="true",
    )
    try:
        yield svc
    finally:
        svc.stop()


def _body(question: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 32,
    }


def _as_job(http: httpx.Client, body: dict) -> str:
    submitted = http.post("/v1/jobs", json={"url": "/v1/chat/completions", "body": body})
    assert submitted.status_code == 202, submitted.text
    job_id = submitted.json()["id"]
    record: dict = {}

    def finished() -> bool:
        record.update(http.get(f"/v1/jobs/{job_id}").json())
        return record["status"] in ("completed", "failed", "cancelled")

    wait_until(finished, 120, f"job {job_id} to finish")
    assert record["status"] == "completed", record
    return record["response"]["choices"][0]["message"]["content"]


def test_stream_non_stream_and_job_give_the_same_greedy_text(service: Service) -> None:
    client = openai.OpenAI(base_url=f"{service.base_url}/v1", api_key="x", max_retries=0)
    with service.client() as http:
        worker = http.get("/v1/workers").json()["data"][0]
        assert worker["deterministic"] is True, worker["deterministic_reason"]
        for question in QUESTIONS:
            body = _body(question)
            texts = []
            for _ in range(2):  # the first time, then with the prompt cached
                texts.append(client.chat.completions.create(**body).choices[0].message.content)
                chunks = client.chat.completions.create(**body, stream=True)
                texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
                texts.append(_as_job(http, body))
            assert texts[0], question
            assert texts == [texts[0]] * len(texts), question

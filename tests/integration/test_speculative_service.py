"""A worker with n-gram speculation on: same answers as the plain engine, metrics exposed."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.engines import make_engine
from tests.support.harness import Service, spare_port, start_service
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM

# A passage quoted twice: the continuation repeats it, so drafts get accepted.
PROMPT = " ".join(f"w{i}" for i in [5, 17, 99, 42, 7, 128, 64] * 3)


@pytest.fixture(scope="module")
def spec_service(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("spec-logs"),
        speculative_ngram=4,
        worker_metrics_port=spare_port(),
    )
    yield svc
    svc.stop()


def test_streamed_and_whole_answers_equal_the_plain_engine(
    spec_service: Service, tiny_service_model: Path
) -> None:
    plain = LLM(engine=make_engine(tiny_service_model))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)
    expected = plain.generate(PROMPT, params)[0].outputs[0]
    body = {
        "model": "x",
        "prompt": PROMPT,
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    with spec_service.client() as client:
        body["model"] = client.get("/v1/models").json()["data"][0]["id"]
        whole = client.post("/v1/completions", json=body).json()
        assert whole["choices"][0]["text"] == expected.text
        assert whole["usage"]["completion_tokens"] == 20
        assert len(whole["choices"][0]["logprobs"]["tokens"]) == 20
        with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
            lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        chunks = [json.loads(line) for line in lines if line != "[DONE]"]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected.text
        spec_service.wait_kv_free(client, timeout=10)
    values = _spec_metrics_once_observed(spec_service.env["LLM_WORKER_METRICS_PORT"])
    assert values["llm_spec_decode_accepted_tokens_total"] > 0
    assert 0 < values["llm_spec_decode_acceptance_rate"] <= 1
    assert values["llm_tokens_per_decode_step"] > 1


def _spec_metrics_once_observed(port: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The worker's speculation metrics, once its heartbeat has copied the engine's stats in
    (they are refreshed each heartbeat, so right after the answers they may still read 0)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith(("llm_spec_decode", "llm_tokens_per_decode_step"))
        }
        if values["llm_spec_decode_accepted_tokens_total"] > 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.1)

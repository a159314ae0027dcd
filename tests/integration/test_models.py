"""Two models in one deployment: each request lands only on its model's workers; /v1/models
lists both; an unknown model is a 404, a known one whose workers are gone a 503."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import add_tiny_tokenizer
from tests.support.harness import Service, start_service, wait_until
from tests.support.tiny_models import tiny_model_dir

NUM_REQUESTS = 6


@pytest.fixture(scope="module")
def second_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tiny_model_dir("llama", tmp_path_factory.mktemp("second-model"), seed=12)
    add_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def two_models(
    tiny_service_model: Path, second_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """Workers 0 and 1 serve the first model, worker 2 the second one (as `other`)."""
    svc = start_service(tiny_service_model, tmp_path_factory.mktemp("models-logs"), num_workers=2)
    svc.start_worker(model_name=second_model, served_model_name="other")
    try:
        svc.wait_ready(3)
    except BaseException:
        svc.stop()
        raise
    yield svc
    svc.stop()


def ask(svc: Service, model: str, text: str) -> tuple[str, str]:
    """(answer, id of the worker that ran it)."""
    with svc.client() as client:
        body = {"model": model, "prompt": text, "max_tokens": 8, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        job = client.get(f"/v1/jobs/{response.headers['X-Job-Id']}").json()
    return response.json()["choices"][0]["text"], job["worker_id"]


def test_each_request_lands_on_its_models_workers(
    two_models: Service, tiny_service_model: Path
) -> None:
    svc = two_models
    first = tiny_service_model.name
    with svc.client() as client:
        listed = {m["id"] for m in client.get("/v1/models").json()["data"]}
    assert listed == {first, "other"}
    answers: dict[str, set[str]] = {first: set(), "other": set()}
    for i in range(NUM_REQUESTS):
        for model, workers in (
            (first, {svc.worker_id(0), svc.worker_id(1)}),
            ("other", {svc.worker_id(2)}),
        ):
            text, worker = ask(svc, model, f"w{5 + i} w9 w17")
            assert worker in workers, (model, worker)
            answers[model].add(text)
    assert answers[first] != answers["other"]  # two different random models answered


def test_unknown_model_404_and_a_model_without_workers_503(two_models: Service) -> None:
    svc = two_models
    with svc.client() as client:
        body = {"model": "nope", "prompt": "w5", "max_tokens": 2}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
        svc.signal_worker(2, signal.SIGTERM)  # a clean stop removes its heartbeat at once
        svc.workers[2].wait(timeout=30)
        wait_until(
            lambda: "other" not in {m["id"] for m in client.get("/v1/models").json()["data"]},
            10,
            "model 'other' gone from /v1/models",
        )
        response = client.post("/v1/completions", json={**body, "model": "other"})
        assert response.status_code == 503 and response.headers["Retry-After"]
        assert response.json()["error"]["code"] == "no_workers"

"""Schema-driven fuzzing of the real API (tiny model, one worker): no input may cause a 5xx.

Schemathesis generates requests from the app's own OpenAPI schema (request bodies are
declared in it by `api.openai.protocol.openapi_body`), valid and invalid ones, for every operation,
under a small per-operation budget (`LADLE_FUZZ_EXAMPLES`, default 8). The longer run:
`python -m loadtest.fuzz` (see docs/reliability.md, "Bad input").
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.harness import Service, start_service

schemathesis = pytest.importorskip("schemathesis")

from loadtest.fuzz import fuzz  # noqa: E402  (needs schemathesis)

MAX_EXAMPLES = int(os.environ.get("LADLE_FUZZ_EXAMPLES", "8"))


@pytest.fixture(scope="module")
def fuzz_service(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    # A short context keeps generated completions quick.
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("fuzz-logs"),
        max_model_len=64,
        request_timeout_s=20,
    )
    yield svc
    svc.stop()


def test_no_input_causes_a_server_error(fuzz_service: Service) -> None:
    # The budget is a ceiling for a hung run, not a measure of speed: how many calls fit in a
    # fixed time depends on the machine, so the check is that every operation was called.
    report = fuzz(fuzz_service.base_url, max_examples=MAX_EXAMPLES, time_budget_s=600)
    assert report.operations >= 13 and report.calls >= 2 * report.operations
    assert report.failures == [], "\n".join(report.failures)

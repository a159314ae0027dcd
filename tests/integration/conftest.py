from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import add_tiny_tokenizer
from tests.support.harness import Service, redis_available, start_service
from tests.support.tiny_models import tiny_model_dir


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/integration" in str(item.fspath):
            item.add_marker(pytest.mark.redis)


@pytest.fixture(scope="session", autouse=True)
def _require_redis() -> None:
    if not redis_available():
        pytest.fail(
            "integration tests need Redis at LLM_TEST_REDIS_URL "
            "(default redis://127.0.0.1:6379/15); .ci/run starts one"
        )


@pytest.fixture(scope="session")
def tiny_service_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer and a chat template."""
    path = tiny_model_dir("llama", tmp_path_factory.mktemp("service-model"), seed=11)
    add_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def service(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(tiny_service_model, tmp_path_factory.mktemp("logs"), num_workers=1)
    yield svc
    svc.stop()

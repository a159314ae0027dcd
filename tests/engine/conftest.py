"""Engine fixtures: one tiny model directory per family, and engines whose KV blocks must all
be free when a test ends. The helpers live in tests.support.engines."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.engines import add_tiny_tokenizer, assert_all_blocks_free
from tests.support.tiny_models import tiny_model_dir
from worker.engine.engine import LLMEngine


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_models_root: Path) -> dict[str, Path]:
    """One tiny HF directory (weights + tokenizer) per family, built once per session."""
    dirs = {}
    for family in ("llama", "qwen2", "qwen3"):
        path = tiny_model_dir(family, tiny_models_root)
        add_tiny_tokenizer(path)
        dirs[family] = path
    return dirs


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Collects the engines a test builds and checks all their blocks are free at the end."""
    built: list[LLMEngine] = []
    yield built
    for engine in built:
        assert_all_blocks_free(engine)

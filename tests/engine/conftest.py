"""Engine fixtures: tiny random models with a small word-level tokenizer, and a check that
every KV block is free when a test ends."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.tiny_models import tiny_model_dir
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine

TINY_VOCAB = 256
# `LADLE_TEST_DEVICE=cuda pytest tests/engine` runs the engine tests on a GPU (CUDA graphs
# on); references stay transformers on the CPU in float32.
TEST_DEVICE = os.environ.get("LADLE_TEST_DEVICE", "cpu")
cpu_only = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="checks a CPU-only mechanism")


def add_tiny_tokenizer(model_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A word-level tokenizer whose token i is the word `w{i}` (ids 0-2 are special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w3{% endif %}"
    )
    tokenizer.save_pretrained(str(model_dir))


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


def make_engine(model_dir: Path, **overrides: object) -> LLMEngine:
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device=TEST_DEVICE,
        kv_cache_size_mb=4,
        max_num_batched_tokens=256,
        num_threads=1,
        # Exactness tests run the eager forward on plain F.linear, never timing-dependent;
        # the compiled path, the kernel choice and the batch-invariant mode have their own
        # tests (test_determinism.py runs the default mode).
        compile="off",
        linear_kernel="plain",
        deterministic=False,
    )
    for key, value in overrides.items():
        setattr(config, key, value)
    return LLMEngine(config)


def assert_all_blocks_free(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_used_blocks} KV blocks still used"


@pytest.fixture
def engines() -> Iterator[list[LLMEngine]]:
    """Collects the engines a test builds and checks all their blocks are free at the end."""
    built: list[LLMEngine] = []
    yield built
    for engine in built:
        assert_all_blocks_free(engine)

"""Engines for tests: tiny random models with a small word-level tokenizer, an engine built
the way exactness tests need it, and a check that every KV block is free."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
    local = getattr(bm, "local", None)  # sliding-window layers' own pool
    if local is not None:
        assert local.num_free_blocks == local.num_blocks, f"{local.num_used_blocks} local blocks"


def require_native(bf16: bool = True) -> None:
    """Load the native kernels, or skip where this machine cannot have them (no x86-64, no
    compiler, neither AVX2 nor AVX-512; with `bf16`, no AVX512-BF16: the float32 matmul and
    attention alone build for AVX2); a build that fails where they should build fails."""
    from worker.layers import native

    if native.configure(True):
        if bf16 and not native.bf16():
            pytest.skip(f"bf16 kernels unavailable here: {native.status()}")
        return
    reason = native.status()
    if reason.startswith("build or load failed"):
        pytest.fail(f"native kernels did not build: {reason}")
    pytest.skip(f"native kernels unavailable here: {reason}")

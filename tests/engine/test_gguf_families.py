"""GGUF files of every family, as llama.cpp's converter names their tensors and metadata
(`tests/support/tiny_gguf.py`): a tiny random model written to GGUF and loaded back generates
greedily exactly what transformers generates on the original float32 weights."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_engine import GREEDY, hf_greedy, random_prompts, token_ids
from tests.support.engines import add_tiny_tokenizer, make_engine
from tests.support.tiny_gguf import float32_model, write_gguf
from tests.support.tiny_models import tiny_model_dir
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM
from worker.models.gguf_convert import convert_gguf

# family -> the HF architecture its GGUF must come back as
FAMILIES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",  # a config transformers' GGUF reader does not know
}


def converted(family: str, root: Path) -> tuple[Path, Path]:
    """(the original HF directory, the directory converted from its GGUF)."""
    model_dir = tiny_model_dir(family, root)
    gguf_path = root / f"{family}.gguf"
    write_gguf(float32_model(model_dir), gguf_path)
    out = convert_gguf(gguf_path, root / f"{family}-from-gguf", with_tokenizer=False)
    add_tiny_tokenizer(out)
    return model_dir, out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gguf_of_family_generates_as_transformers(
    family: str, tmp_path: Path, engines: list[LLMEngine]
) -> None:
    model_dir, out = converted(family, tmp_path)
    prompts = random_prompts(3, [5, 17, 40], seed=5)
    engine = make_engine(out)
    engines.append(engine)
    assert engine.executor.loaded.hf_config.architectures == [FAMILIES[family]]
    ours = token_ids(LLM(engine=engine).generate(prompts, GREEDY))
    assert ours == hf_greedy(model_dir, prompts, GREEDY.max_tokens)

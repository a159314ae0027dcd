"""Every family beyond Llama's through the whole engine, token for token against transformers
in float32: chunked prefill and decode in a mixed batch, a prefix-cache hit, preemption.

The tiny configs (tests/support/tiny_models.py) have windows of 8 and prompts up to 40 tokens,
so sliding-window layers, soft-caps, MoE routing and LongRoPE all act."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.engine.test_engine import GREEDY, hf_greedy, random_prompts, token_ids
from tests.support.engines import add_tiny_tokenizer, make_engine
from tests.support.tiny_models import tiny_model_dir
from worker.engine.core.hybrid_blocks import HybridBlockManager
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM

# family -> overrides of its tiny config
CASES = {
    "gemma2": {},
    "gemma3": {},
    "phi3": {},
    "mixtral": {},
    "qwen2_moe": {},
    "qwen3_moe": {},
    "olmoe": {},
    "mistral_window": {"sliding_window": 8},
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for case, overrides in CASES.items():
        family = case.removesuffix("_window")
        path = tiny_model_dir(family, root / case, **overrides)
        add_tiny_tokenizer(path)
        dirs[case] = path
    return dirs


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_equals_transformers_chunked_cached_and_preempted(
    case: str, family_dirs: dict[str, Path], engines: list[LLMEngine]
) -> None:
    model_dir = family_dirs[case]
    prompts = random_prompts(5, [1, 9, 17, 30, 40], seed=11)
    expected = hf_greedy(model_dir, prompts, GREEDY.max_tokens)

    engine = make_engine(model_dir, max_num_batched_tokens=32)  # prompts come in chunks
    engines.append(engine)
    llm = LLM(engine=engine)
    assert token_ids(llm.generate(prompts, GREEDY)) == expected
    again = llm.generate(prompts[3:], GREEDY)  # their full blocks are cached now
    assert token_ids(again) == expected[3:]
    assert all(r.usage.cached_tokens > 0 for r in again)

    tight = make_engine(model_dir, enable_prefix_caching=False)
    bm = tight.block_manager  # Gemma's global layers: the full pool of two
    pool = bm.full if isinstance(bm, HybridBlockManager) else bm
    pool.__init__(12, tight.config.block_size, False)  # 192 tokens for 5
    engines.append(tight)
    longer = replace(GREEDY, max_tokens=32)
    ours = token_ids(LLM(engine=tight).generate(prompts, longer))
    assert tight.scheduler.num_preemptions_total > 0
    assert ours == hf_greedy(model_dir, prompts, longer.max_tokens)


def test_longrope_takes_the_long_factors_from_the_original_length_on() -> None:
    """Within `original_max_position_embeddings` a position's rotation is HF's short one
    (the engine tests above); from it on, HF's long one (HF then recomputes the whole sequence
    with the long factors, which a paged cache does not: see worker/layers/rotary.py)."""
    import torch
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from tests.support.tiny_models import tiny_config
    from worker.layers.rotary import RotaryEmbedding, rope_parameters

    config = tiny_config("phi3")
    reference = Phi3RotaryEmbedding(config)
    ours = RotaryEmbedding(rope_parameters(config), 16, 512)
    ours.build_cache()
    assert ours.rotary_dim == 8  # partial_rotary_factor 0.5
    for position in (0, 5, 127, 128, 300):
        cos, sin = reference(torch.zeros(1), torch.tensor([[position]]))
        torch.testing.assert_close(ours.cos_cache[position], cos[0, 0], atol=0, rtol=0)

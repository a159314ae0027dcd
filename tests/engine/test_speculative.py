"""N-gram speculative decoding end to end: same tokens as without it, blocks all free after."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from tests.engine.test_engine import random_prompts
from tests.support.engines import make_engine
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM, GenerationResult

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
NUM_DRAFTS = 4
ONE_TOKEN = {"speculative_ngram_size": 1}


def quoting_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts that repeat a passage, so the model's continuation often repeats it too."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        passage = [rng.randrange(3, 256) for _ in range(rng.randint(5, 12))]
        prompts.append(passage * rng.randint(2, 4) + passage[: rng.randint(1, 4)])
    return prompts


def generate(
    model_dir: Path,
    engines: list[LLMEngine],
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    num_drafts: int,
    **config: object,
) -> tuple[list[GenerationResult], LLMEngine]:
    engine = make_engine(model_dir, speculative_ngram=num_drafts, **config)
    engines.append(engine)
    return LLM(engine=engine).generate(prompts, params), engine


def outputs(results: list[GenerationResult]) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason) for r in results for o in r.outputs]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_output_is_identical_with_speculation_on_and_off(
    family: str, tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    prompts = quoting_prompts(8, seed=1) + random_prompts(8, [7, 30], seed=2)
    plain, _ = generate(tiny_model_dirs[family], engines, prompts, GREEDY, 0)
    spec, engine = generate(tiny_model_dirs[family], engines, prompts, GREEDY, NUM_DRAFTS)
    assert outputs(spec) == outputs(plain)
    stats = engine.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens
    assert stats.num_decode_tokens == sum(len(o[0]) - 1 for o in outputs(spec))
    assert stats.num_decode_steps < stats.num_decode_tokens  # more than one token per step


def test_seeded_sampling_is_reproducible_and_unchanged_by_speculation(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    model_dir = tiny_model_dirs["llama"]
    prompts = quoting_prompts(6, seed=3)
    kinds = [
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=20, min_p=0.05),
    ]
    params = [
        replace(kinds[i % 3], seed=100 + i, max_tokens=24, ignore_eos=True, n=1 + i % 2)
        for i in range(6)
    ]
    # Single-token matches: sampled text from a tiny random model rarely repeats two tokens.
    first, engine = generate(model_dir, engines, prompts, params, NUM_DRAFTS, **ONE_TOKEN)
    assert engine.stats().num_spec_accepted_tokens > 0
    # Again, next to unseeded neighbours that change the batch.
    noise = random_prompts(4, [9, 25], seed=4)
    unseeded = [SamplingParams(temperature=1.0, max_tokens=16)] * 4
    second, _ = generate(
        model_dir, engines, prompts + noise, params + unseeded, NUM_DRAFTS, **ONE_TOKEN
    )
    plain, _ = generate(model_dir, engines, prompts, params, 0)
    assert outputs(second[:6]) == outputs(first) == outputs(plain)


def test_stops_limits_and_logprobs_apply_per_accepted_token(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    model_dir = tiny_model_dirs["llama"]
    prompts = quoting_prompts(4, seed=5)
    free, _ = generate(model_dir, engines, prompts, GREEDY, 0)
    variants = [replace(GREEDY, logprobs=2), replace(GREEDY, max_tokens=7)]
    for result in free:
        tokens = result.outputs[0].token_ids
        variants.append(replace(GREEDY, stop_token_ids=[tokens[5]]))
        variants.append(replace(GREEDY, stop=[f"w{tokens[6]}"], max_tokens=30))
        variants.append(replace(GREEDY, ignore_eos=False, logprobs=0))
    all_prompts = [prompts[i % 4] for i in range(len(variants))]
    plain, _ = generate(model_dir, engines, all_prompts, variants, 0)
    spec, engine = generate(model_dir, engines, all_prompts, variants, NUM_DRAFTS)
    assert engine.stats().num_spec_accepted_tokens > 0
    assert outputs(spec) == outputs(plain)
    assert [r.usage.completion_tokens for r in spec] == [r.usage.completion_tokens for r in plain]
    for ours, theirs in zip(spec, plain, strict=True):
        ours_lp, theirs_lp = ours.outputs[0].logprobs, theirs.outputs[0].logprobs
        if theirs_lp is None:
            assert ours_lp is None
            continue
        assert len(ours_lp) == len(theirs_lp) == len(ours.outputs[0].token_ids)
        for a, b in zip(ours_lp, theirs_lp, strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top or []] == [t.token_id for t in b.top or []]


def test_preemption_and_abort_free_every_block_with_speculation(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    model_dir = tiny_model_dirs["qwen2"]
    prompts = quoting_prompts(12, seed=6)
    params = replace(GREEDY, max_tokens=40)
    plain, _ = generate(model_dir, engines, prompts, params, 0)
    tight = make_engine(model_dir, speculative_ngram=NUM_DRAFTS, enable_prefix_caching=False)
    tight.block_manager.__init__(14, tight.config.block_size, False)
    engines.append(tight)
    spec = LLM(engine=tight).generate(prompts, params)
    assert tight.scheduler.num_preemptions_total > 0
    assert tight.stats().num_spec_accepted_tokens > 0
    assert outputs(spec) == outputs(plain)

    engine = make_engine(model_dir, speculative_ngram=NUM_DRAFTS)
    engines.append(engine)
    llm = LLM(engine=engine)
    for index, prompt in enumerate(prompts[:4]):
        engine.add_request(engine.prepare(f"a{index}", prompt, params))
    while engine.stats().num_spec_draft_tokens == 0:
        engine.step()
    for index in range(4):
        engine.abort_request(f"a{index}")
    assert engine.block_manager.num_used_blocks == 0
    assert outputs(llm.generate(prompts[:2], params)) == outputs(plain[:2])

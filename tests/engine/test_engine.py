"""The whole engine (scheduler + runner + sampler + detokenizer) against transformers."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shared.errors import InvalidRequestError
from tests.support.engines import make_engine
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate(), one prompt at a time, as the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like ignore_eos (min_new_tokens bans EOS)
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        ids = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def random_prompts(count: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(lengths[i % len(lengths)])] for i in range(count)]


def token_ids(results: list) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_in_a_mixed_batch(
    family: str, tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    prompts = random_prompts(6, [1, 7, 16, 17, 40, 95], seed=1)
    engine = make_engine(tiny_model_dirs[family], max_num_batched_tokens=64)
    engines.append(engine)
    ours = token_ids(LLM(engine=engine).generate(prompts, GREEDY))
    assert ours == hf_greedy(tiny_model_dirs[family], prompts, GREEDY.max_tokens)


def test_one_request_is_the_same_alone_in_a_batch_cached_and_preempted(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    model_dir = tiny_model_dirs["llama"]
    target = random_prompts(1, [33], seed=7)[0]
    alone_engine = make_engine(model_dir)
    engines.append(alone_engine)
    alone = token_ids(LLM(engine=alone_engine).generate([target], GREEDY))[0]

    # 16 mixed requests: the target, greedy and sampled neighbours, shared prefixes.
    others = random_prompts(15, [5, 20, 48, 64], seed=8)
    others[3] = target[:16] + others[3]
    rng = random.Random(9)
    params = [GREEDY] + [
        replace(
            GREEDY,
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_p=0.9,
            seed=i,
            max_tokens=rng.randint(4, 24),
        )
        for i in range(15)
    ]
    for caching in (True, False):
        engine = make_engine(model_dir, enable_prefix_caching=caching)
        engines.append(engine)
        llm = LLM(engine=engine)
        llm.generate([target], GREEDY)  # warm the prefix cache when it is on
        batched = llm.generate([target] + others, params)
        assert batched[0].outputs[0].token_ids == alone
        assert (batched[0].usage.cached_tokens > 0) == caching

    # A cache of 12 blocks (192 tokens) cannot hold 16 sequences: preemption must happen.
    tight = make_engine(model_dir, kv_cache_size_mb=1, enable_prefix_caching=False)
    tight.block_manager.__init__(12, tight.config.block_size, False)
    engines.append(tight)
    batched = LLM(engine=tight).generate([target] + others, params)
    assert tight.scheduler.num_preemptions_total > 0
    assert batched[0].outputs[0].token_ids == alone


def test_seeded_sampling_is_reproducible_and_n_fans_out(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    engine = make_engine(tiny_model_dirs["qwen2"])
    engines.append(engine)
    llm = LLM(engine=engine)
    prompt = random_prompts(1, [12], seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True, n=3)
    first = llm.generate([prompt], params)[0]
    noise = random_prompts(5, [9, 30], seed=4)
    second = llm.generate([prompt] + noise, [params] + [replace(params, seed=None, n=1)] * 5)[0]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1  # seeds seed, seed+1, ...
    assert first.usage.completion_tokens == 36


def test_stop_conditions(tiny_model_dirs: dict, engines: list[LLMEngine]) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    engines.append(engine)
    llm = LLM(engine=engine)
    prompt = random_prompts(1, [10], seed=5)[0]
    free = llm.generate([prompt], GREEDY)[0].outputs[0]
    third = free.token_ids[2]
    by_id = llm.generate([prompt], replace(GREEDY, stop_token_ids=[third]))[0].outputs[0]
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(third) + 1]
    assert by_id.finish_reason == "stop"
    stop_word = f"w{free.token_ids[4]}"
    by_text = llm.generate([prompt], replace(GREEDY, stop=[stop_word]))[0].outputs[0]
    assert by_text.finish_reason == "stop" and stop_word not in by_text.text
    assert by_text.token_ids == free.token_ids[: free.token_ids.index(free.token_ids[4]) + 1]
    length = llm.generate([prompt], replace(GREEDY, max_tokens=5))[0].outputs[0]
    assert length.token_ids == free.token_ids[:5] and length.finish_reason == "length"


def test_abort_frees_blocks_at_once(tiny_model_dirs: dict, engines: list[LLMEngine]) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    engines.append(engine)
    llm = LLM(engine=engine)
    prompt = random_prompts(1, [40], seed=6)[0]
    prepared = engine.prepare("job-1", prompt, replace(GREEDY, max_tokens=100))
    engine.add_request(prepared)
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("job-1")
    assert engine.block_manager.num_used_blocks == 0
    assert llm.generate([prompt], GREEDY)[0].outputs[0].finish_reason == "length"


def test_requests_that_do_not_fit_are_refused(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    engine = make_engine(tiny_model_dirs["llama"], max_model_len=64)
    engines.append(engine)
    with pytest.raises(InvalidRequestError, match="maximum context length is 64"):
        engine.prepare("a", list(range(3, 67)), GREEDY)
    with pytest.raises(InvalidRequestError) as info:
        engine.prepare("b", list(range(3, 53)), replace(GREEDY, max_tokens=20))
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError, match="token ids"):
        engine.prepare("c", [3, 999], GREEDY)
    prepared = engine.prepare("d", list(range(3, 53)), replace(GREEDY, max_tokens=None))
    assert prepared.max_tokens == 14  # the default: what fits the context

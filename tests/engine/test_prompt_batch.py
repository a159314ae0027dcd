"""Several prompts under one request id (a completions list): n choices each, indexed
prompt * n + j, each the same as its prompt alone; one abort ends them all."""

from __future__ import annotations

from dataclasses import replace

from tests.support.engines import assert_all_blocks_free, make_engine
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine

PARAMS = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12]]


def outputs(engine: LLMEngine, prompts: list[list[int]]) -> dict[int, list[int]]:
    for number, prompt in enumerate(prompts):
        prepared = engine.prepare("job", prompt, PARAMS)
        engine.add_request(replace(prepared, first_index=number * PARAMS.n))
    tokens: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "job"
            tokens.setdefault(out.index, []).extend(out.new_token_ids)
    assert_all_blocks_free(engine)
    return tokens


def test_each_prompt_gets_its_own_choices_in_order(tiny_model_dirs: dict) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    both = outputs(engine, PROMPTS)
    assert sorted(both) == [0, 1, 2, 3]
    assert [both[0], both[1]] == list(outputs(engine, PROMPTS[:1]).values())
    second_alone = outputs(engine, PROMPTS[1:])
    assert [both[2], both[3]] == [second_alone[0], second_alone[1]]


def test_one_abort_ends_every_prompt(tiny_model_dirs: dict) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    for number, prompt in enumerate(PROMPTS):
        engine.add_request(replace(engine.prepare("job", prompt, PARAMS), first_index=2 * number))
    engine.step()
    assert engine.abort_request("job")
    assert_all_blocks_free(engine)

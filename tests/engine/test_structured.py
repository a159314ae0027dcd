"""Constrained decoding in the engine: every output follows its grammar, unconstrained rows
are untouched, and n > 1, seeds, preemption, stop strings and max_tokens behave."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from shared.errors import InvalidRequestError
from shared.grammar import build_grammar
from tests.support.engines import assert_all_blocks_free, make_engine
from tests.support.tiny_bytes import tiny_byte_model_dir
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine, SequenceOutput

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_byte_model_dir("qwen2", tmp_path_factory.mktemp("bytes"))


@pytest.fixture(scope="module")
def engine(byte_model: Path) -> LLMEngine:
    return make_engine(byte_model, max_model_len=512)


Spec = tuple[SamplingParams, str | None]


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], Spec]]) -> dict:
    """Generate every request to the end; {request_id: {index: (text, ids, finish)}}."""
    for request_id, (prompt, (params, grammar)) in requests.items():
        engine.add_request(engine.prepare(request_id, prompt, params, grammar=grammar))
    results: dict[str, dict[int, list]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            _collect(results, out)
    assert_all_blocks_free(engine)
    return results


def _collect(results: dict, out: SequenceOutput) -> None:
    entry = results.setdefault(out.request_id, {}).setdefault(out.index, ["", [], None])
    entry[0] += out.new_text
    entry[1] += out.new_token_ids
    entry[2] = out.finish_reason


def json_params(schema: dict, **kwargs: object) -> Spec:
    kwargs.setdefault("max_tokens", 400)
    return SamplingParams(**kwargs), build_grammar("json_schema", schema)  # type: ignore[arg-type]


PROMPT = [104, 105, 10]


def test_every_schema_at_temperature_one_parses_and_validates(engine: LLMEngine) -> None:
    requests = {
        case["name"]: (PROMPT, json_params(case["schema"], seed=i, n=2))
        for i, case in enumerate(SCHEMAS)
    }
    results = run(engine, requests)
    for case in SCHEMAS:
        for text, _ids, finish in results[case["name"]].values():
            assert finish == "stop", (case["name"], text)
            jsonschema.validate(json.loads(text), case["schema"], format_checker=CHECKER)


def test_unconstrained_rows_are_untouched_by_constrained_neighbours(engine: LLMEngine) -> None:
    free = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True), None
    alone = run(engine, {"free": (PROMPT, free)})
    schema = SCHEMAS[0]["schema"]
    mixed = run(engine, {"free": (PROMPT, free), "json": (PROMPT, json_params(schema, seed=1))})
    assert mixed["free"] == alone["free"]


def test_seeded_constrained_output_is_reproducible_and_greedy_works(engine: LLMEngine) -> None:
    schema = SCHEMAS[4]["schema"]
    first = run(engine, {"a": (PROMPT, json_params(schema, seed=3))})
    again = run(engine, {"a": (PROMPT, json_params(schema, seed=3))})
    assert first == again
    greedy = run(engine, {"g": (PROMPT, json_params(schema, temperature=0.0))})
    jsonschema.validate(json.loads(greedy["g"][0][0]), schema)


def test_max_tokens_mid_object_ends_with_length(engine: LLMEngine) -> None:
    results = run(engine, {"cut": (PROMPT, json_params(SCHEMAS[19]["schema"], max_tokens=5))})
    text, ids, finish = results["cut"][0]
    assert finish == "length" and len(ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_stop_strings_still_apply(engine: LLMEngine) -> None:
    params = json_params(SCHEMAS[0]["schema"], seed=0, stop=['"age"'])
    text, _ids, finish = run(engine, {"s": (PROMPT, params)})["s"][0]
    assert finish == "stop" and text.startswith('{"name": "') and text.endswith('", ')
    assert set(json.loads(text[:-2] + "}")) == {"name"}


def test_choice_and_regex_grammars(engine: LLMEngine) -> None:
    choice = SamplingParams(seed=1, n=4), build_grammar("choice", ["soup", "stew"])
    regex = SamplingParams(seed=2), build_grammar("regex", r"[A-Z]{3}-[0-9]{2}")
    results = run(engine, {"c": (PROMPT, choice), "r": (PROMPT, regex)})
    assert {text for text, _, _ in results["c"].values()} <= {"soup", "stew"}
    assert all(finish == "stop" for _, _, finish in results["c"].values())
    assert len(results["r"][0][0]) == 6 and results["r"][0][0][3] == "-"


def test_preemption_keeps_the_matcher_in_step(byte_model: Path) -> None:
    """A cache too small for all sequences: preempted ones recompute and still validate,
    with the same tokens as in a roomy cache (seeded)."""
    schema = SCHEMAS[12]["schema"]

    def requests() -> dict:
        return {
            f"r{i}": (PROMPT * 8, json_params(schema, seed=i, max_tokens=200)) for i in range(6)
        }

    roomy = run(make_engine(byte_model, max_model_len=512), requests())
    # 16 blocks (256 tokens) hold one sequence but not six: preemption must happen.
    tight = make_engine(byte_model, max_model_len=512, enable_prefix_caching=False)
    tight.block_manager.__init__(16, tight.config.block_size, False)
    cramped = run(tight, requests())
    assert tight.scheduler.num_preemptions_total > 0
    assert cramped == roomy


def test_a_grammar_that_does_not_compile_is_a_400(engine: LLMEngine) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        engine.prepare("bad", PROMPT, SamplingParams(), grammar="start: /[a-/")
    assert caught.value.param == "response_format"
    assert caught.value.code == "invalid_schema"


def test_compiled_grammars_are_cached_by_hash(engine: LLMEngine) -> None:
    grammar = build_grammar("json_schema", SCHEMAS[2]["schema"])
    engine.grammars.matcher(grammar)
    cached = len(engine.grammars._cache)
    first, second = engine.grammars.matcher(grammar), engine.grammars.matcher(grammar)
    assert len(engine.grammars._cache) == cached and first.raw is not second.raw


def test_a_grammar_spells_non_special_added_tokens(engine: LLMEngine) -> None:
    """`<tool_call>` is an added, non-special token (as in Qwen): a grammar that spells it
    must be able to emit it (llguidance alone offers the token, then refuses it)."""
    text = '<tool_call>\n{"name": "f"}\n</tool_call>'
    grammar = build_grammar("regex", text.replace("{", r"\{").replace("}", r"\}"))
    results = run(engine, {"t": (PROMPT, (SamplingParams(seed=0), grammar))})
    assert results["t"][0][0] == text and results["t"][0][2] == "stop"

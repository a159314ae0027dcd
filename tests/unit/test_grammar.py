"""The API side of structured outputs: grammars built and checked without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from api.openai.tools import MAX_PARALLEL_CALLS, required_calls_schema
from shared.grammar import GrammarError, build_grammar, close_objects


def test_the_api_compiles_schemas_without_importing_torch() -> None:
    code = (
        "import sys, api.app, api.openai.constraints\n"
        "from shared.grammar import build_grammar\n"
        "build_grammar('json_schema', {'properties': {'a': {'type': 'integer'}}})\n"
        "build_grammar('regex', '[a-z]+')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("kind", "value"),
    [
        ("json_schema", {"type": "nonsense"}),
        ("json_schema", [1]),
        ("regex", "[a-"),
        ("choice", []),
        ("choice", ["a", 1]),
        ("grammar", "start: missing_rule"),
    ],
)
def test_specs_that_do_not_compile_raise_grammar_error(kind: str, value: object) -> None:
    with pytest.raises(GrammarError):
        build_grammar(kind, value)  # type: ignore[arg-type]


def test_json_is_laid_out_like_json_dumps() -> None:
    grammar = build_grammar("json_object", None)
    assert '"whitespace_flexible":false' in grammar.replace(" ", "")
    assert build_grammar("json_schema", {"type": "object"}) == grammar


def test_close_objects_forbids_unlisted_members_where_the_schema_is_silent() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
        "anyOf": [{"properties": {"c": {}}, "additionalProperties": True}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["anyOf"][0]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the input is not changed


def test_forced_calls_are_one_or_at_most_the_parallel_cap() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert required_calls_schema([tool], parallel=False)["maxItems"] == 1
    parallel = required_calls_schema([tool], parallel=True)
    assert parallel["minItems"] == 1 and parallel["maxItems"] == MAX_PARALLEL_CALLS


@pytest.fixture(scope="module")
def accepts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from tests.support.grammar_accepts import byte_acceptor

    return byte_acceptor(tmp_path_factory.mktemp("bytes"))


DIGITS_40 = "1" * 40
NUMBER_CASES = [
    ("json_object", None, '{"a": [1.5, {"b": -12345678901234567.25}], "c": null}', True),
    ("json_object", None, '{"a": "' + DIGITS_40 + '"}', True),  # strings are not numbers
    ("json_object", None, '{"a": ' + DIGITS_40 + "}", False),
    ("json_object", None, '{"a": [0.' + DIGITS_40 + "]}", False),
    ("json_object", None, '{"a": 1e400}', False),
    ("json_schema", {"type": "number"}, "3.14159", True),
    ("json_schema", {"type": "number"}, "1" * 18, False),
    ("json_schema", {"type": "number", "minimum": 0, "maximum": 1}, "0." + "3" * 20, False),
    ("json_schema", {"type": "integer"}, "9" * 17, True),
    ("json_schema", {"type": "integer"}, "9" * 18, False),
    ("json_schema", {"properties": {"x": {}}}, '{"x": ' + DIGITS_40 + "}", False),
]


@pytest.mark.parametrize(("kind", "schema", "text", "allowed"), NUMBER_CASES)
def test_json_numbers_are_bounded_to_what_a_float64_carries(
    accepts, kind: str, schema: object, text: str, allowed: bool
) -> None:
    assert accepts(build_grammar(kind, schema), text) is allowed  # type: ignore[arg-type]


def test_tool_arguments_numbers_are_bounded_too(accepts) -> None:
    params = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = {"type": "function", "function": {"name": "f", "parameters": params}}
    grammar = build_grammar("json_schema", required_calls_schema([tool], parallel=False))
    call = '[{"name": "f", "parameters": {"x": %s}}]'
    assert accepts(grammar, call % "2.5")
    assert not accepts(grammar, call % DIGITS_40)

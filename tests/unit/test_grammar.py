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

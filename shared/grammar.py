"""Structured-output grammars: one request spec -> one llguidance grammar string.

The API builds and checks the grammar before a job exists (a bad schema is a 400 naming the
parameter); the worker compiles the same string into token matchers. llguidance was chosen
by measuring (`python -m loadtest.grammar_pick`; docs/benchmarks.md, "Structured outputs and
tools"): it imports no torch, so the API can use it too, and readies matchers fastest.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from typing import Any, Literal

from shared.json_numbers import bound_numbers

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Any JSON object: what `response_format: {"type": "json_object"}` promises.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
# JSON laid out as Python's json.dumps does, no free whitespace: with llguidance's default
# (any whitespace between tokens) small models at temperature 1 pad with newlines and tabs
# until max_tokens. A schema's own "x-guidance" options still win.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The spec cannot become a grammar (bad schema, regex or grammar text)."""


def build_grammar(kind: GrammarKind, value: Any) -> str:
    """The llguidance grammar for a spec; GrammarError when it does not compile.

    `value`: a JSON schema (dict) for json_schema, a regex, a list of strings for choice,
    a Lark or GBNF grammar text for grammar; ignored for json_object.
    """
    from llguidance import LLMatcher, grammar_from

    try:
        if kind in ("json_schema", "json_object"):
            schema = JSON_OBJECT_SCHEMA if kind == "json_object" else value
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            schema = bound_numbers(schema)
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        elif kind == "choice":
            grammar = _choice_grammar(value)
        else:
            grammar = grammar_from("regex" if kind == "regex" else "grammar", value)
    except GrammarError:
        raise
    except Exception as exc:  # llguidance's own errors: any bad input is the caller's 400
        raise GrammarError(str(exc)) from exc
    except BaseException as exc:  # a Rust panic surfaces as pyo3's PanicException
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"the grammar engine rejected it: {exc}") from None
    check_grammar(grammar)
    return grammar


def _choice_grammar(choices: Any) -> str:
    from llguidance import LLMatcher

    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings")
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def check_grammar(grammar: str) -> None:
    """Raise GrammarError with llguidance's message if the grammar does not compile."""
    error = _validate(grammar)
    if error:
        raise GrammarError(error.strip().splitlines()[0][:500])


@lru_cache(maxsize=1024)
def _validate(grammar: str) -> str:
    """'' or the first error; cached, as clients resend the same schema."""
    from llguidance import LLMatcher

    try:
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    except BaseException as exc:  # a Rust panic (PanicException) or an error: not compilable
        if not isinstance(exc, Exception) and type(exc).__name__ != "PanicException":
            raise
        return f"the grammar engine rejected it: {exc}"
    return messages[0] if is_error else ""


def close_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that lists properties
    and says nothing about others, as OpenAI's strict mode requires. Otherwise JSON Schema
    allows any extra member, and a small model at temperature 1 may write extra JSON until
    max_tokens (seen with SmolLM2 on a tool whose parameters omitted it)."""
    if isinstance(schema, list):
        return [close_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: close_objects(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def grammar_key(grammar: str) -> str:
    """The cache key of a grammar (its SHA-256)."""
    return hashlib.sha256(grammar.encode()).hexdigest()

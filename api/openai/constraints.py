"""Structured outputs and tools in a request -> the job's grammar and tool-call spec.

Everything is checked here, before a job exists: a schema, regex or grammar that does not
compile is a 400 naming its parameter (code `invalid_schema`), conflicting or unsupported
choices are 400s naming theirs. No torch is imported (llguidance compiles on the CPU alone).
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

from api.errors import APIError
from api.openai.auto_tools import CONSTRAINED_FORMATS, auto_tools_lark
from api.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from api.openai.tools import named_call_schema, render_tool_messages, required_calls_schema
from shared.contracts import StructuredSpec, ToolCallSpec
from shared.grammar import GrammarError, GrammarKind, build_grammar, close_objects
from shared.tool_format import template_takes_tools, tokenizer_tool_format

log = logging.getLogger(__name__)
_INVALID = "invalid_parameter"


def check_request(request: OpenAIRequest) -> None:
    """Cross-field rules pydantic cannot name a parameter for; logs unknown fields."""
    if request.model_extra:
        log.info("ignored unknown request fields", extra={"fields": sorted(request.model_extra)})
    if isinstance(request, CompletionRequest) and request.best_of not in (None, request.n):
        if request.best_of is not None and request.best_of < request.n:
            raise APIError(400, "best_of must be at least n", param="best_of", code=_INVALID)
        raise APIError(
            400,
            "best_of other than n is not supported (sample n choices instead)",
            param="best_of",
            code="unsupported_parameter",
        )
    if request.response_format and request.structured_outputs:
        raise APIError(
            400,
            "give either response_format or structured_outputs, not both",
            param="structured_outputs",
            code=_INVALID,
        )


def output_spec(request: OpenAIRequest) -> tuple[StructuredSpec | None, ToolCallSpec | None]:
    """The grammar constraining the output and how tool calls are read out of it."""
    tool_spec, tool_schema = _tool_choice(request)
    if tool_schema is not None:
        if request.response_format or request.structured_outputs:
            param = "response_format" if request.response_format else "structured_outputs"
            message = f"{param} cannot be combined with a forced tool call"
            raise APIError(400, message, param=param, code=_INVALID)
        return _compile("json_schema", tool_schema, "tools", "tool_calls"), tool_spec
    return _requested_format(request), tool_spec


def _requested_format(request: OpenAIRequest) -> StructuredSpec | None:
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        return _compile("json_object", None, "response_format", "json_object")
    if fmt is not None and fmt.json_schema is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        if fmt.json_schema.strict:
            schema = close_objects(schema)
        return _compile("json_schema", schema, "response_format.json_schema.schema", "json_schema")
    outputs = request.structured_outputs
    if outputs is None:
        return None
    if outputs.json_object:
        return _compile("json_object", None, "structured_outputs.json_object", "json_object")
    if outputs.json_ is not None:
        schema = _schema_value(outputs.json_, "structured_outputs.json")
        return _compile("json_schema", schema, "structured_outputs.json", "json_schema")
    kind: GrammarKind = "regex" if outputs.regex else "choice" if outputs.choice else "grammar"
    value = outputs.regex or outputs.choice or outputs.grammar
    return _compile(kind, value, f"structured_outputs.{kind}", kind)


def _schema_value(value: dict[str, Any] | str, param: str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise APIError(
            400, f"{param} is not valid JSON", param=param, code="invalid_schema"
        ) from exc
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON object", param=param, code="invalid_schema")
    return schema


def _compile(kind: GrammarKind, value: Any, param: str, label: str) -> StructuredSpec:
    try:
        grammar = build_grammar(kind, value)
    except GrammarError as exc:
        raise APIError(
            400, f"{param} cannot be used: {exc}", param=param, code="invalid_schema"
        ) from exc
    return StructuredSpec(kind=label, grammar=grammar, param=param)  # type: ignore[arg-type]


def _tool_choice(request: OpenAIRequest) -> tuple[ToolCallSpec | None, dict[str, Any] | None]:
    """(how to read calls, the schema forcing them or None) from tools and tool_choice."""
    if not isinstance(request, ChatCompletionRequest):
        return None, None
    tools = [tool.model_dump(by_alias=True) for tool in request.tools or []]
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code=_INVALID)
        return None, None
    if choice == "none":
        return None, None
    if choice in (None, "auto"):
        return ToolCallSpec(mode="auto", names=[t["function"]["name"] for t in tools]), None
    if choice == "required":
        schema = required_calls_schema(tools, request.parallel_tool_calls)
        return ToolCallSpec(mode="required"), schema
    assert not isinstance(choice, str)
    schema = named_call_schema(tools, choice.function.name)
    if schema is None:
        message = f"tool_choice names {choice.function.name!r}, which is not in tools"
        raise APIError(400, message, param="tool_choice", code=_INVALID)
    return ToolCallSpec(mode="named", function=choice.function.name), schema


def auto_tools_spec(
    request: OpenAIRequest, structured: StructuredSpec | None, tool_spec: ToolCallSpec | None
) -> StructuredSpec | None:
    """Under `auto`, with no other constraint, the grammar of "text, or a well-formed call"
    for the model's format (`api/openai/auto_tools.py`); else `structured` as it is."""
    if structured is not None or tool_spec is None or tool_spec.mode != "auto":
        return structured
    if tool_spec.format not in CONSTRAINED_FORMATS or not isinstance(
        request, ChatCompletionRequest
    ):
        return structured
    tools = [tool.model_dump(by_alias=True) for tool in request.tools or []]
    return _compile("grammar", auto_tools_lark(tools), "tools", "tool_calls")


def chat_inputs(tokenizer: Any, request: ChatCompletionRequest) -> tuple[list[dict], dict]:
    """Messages and extra template kwargs: tools through the template or the fallback."""
    messages = [m.as_dict() for m in request.messages]
    tools = [t.model_dump(by_alias=True, exclude_none=True) for t in request.tools or []]
    has_history = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_history:
        return messages, {}
    return render_tool_messages(messages, tools or None, _takes_tools(tokenizer))


def with_tool_format(spec: ToolCallSpec | None, tokenizer: Any) -> ToolCallSpec | None:
    """The auto parser's format, from the model's template (the fallback prompt is Hermes)."""
    if spec is None or spec.mode != "auto":
        return spec
    return spec.model_copy(update={"format": _tool_format(tokenizer)})


@functools.lru_cache(maxsize=8)
def _tool_format(tokenizer: Any) -> str:
    return tokenizer_tool_format(tokenizer)


@functools.lru_cache(maxsize=8)
def _takes_tools(tokenizer: Any) -> bool:
    render = getattr(tokenizer, "chat_text", None)  # test doubles may render no templates
    return render is not None and template_takes_tools(render)

"""Tools in the prompt and in the grammar.

Definitions reach the model through its chat template when the template takes `tools` (Qwen2,
Qwen3, Llama 3.1+, Hermes do); otherwise through one fallback system prompt
(`FALLBACK_TOOLS_PROMPT`), which asks for Hermes-style `<tool_call>` blocks. Assistant
`tool_calls` and `tool` messages in the history go to a tools template as they are; for
other templates they become text in the same Hermes format.

`tool_choice: "required"` and a named function are grammar-constrained (as vLLM does): the
answer is a JSON array of `{"name", "parameters"}` calls, or the named function's arguments.
"""

from __future__ import annotations

import json
from typing import Any

from shared.grammar import close_objects

FALLBACK_TOOLS_PROMPT = (
    "You can call functions. Their signatures are in <tools></tools>:\n<tools>\n{tools}\n"
    "</tools>\nTo call a function, answer with one <tool_call></tool_call> block per call, "
    'each holding {{"name": <function-name>, "arguments": <arguments-object>}}, and nothing '
    "else. Results come back in <tool_response></tool_response>."
)


def render_tool_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, takes_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Messages and template kwargs that carry `tools` and the tool history to the model."""
    if takes_tools:
        return messages, ({"tools": tools} if tools else {})
    converted = [_as_text(message) for message in messages]
    if tools:
        prompt = FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if converted and converted[0]["role"] in ("system", "developer"):
            first = converted[0]
            converted[0] = {**first, "content": f"{first.get('content') or ''}\n\n{prompt}"}
        else:
            converted.insert(0, {"role": "system", "content": prompt})
    return converted, {}


def _as_text(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant call or a tool result as plain text for a template without tools."""
    if message.get("tool_calls"):
        blocks = [_call_block(call["function"]) for call in message["tool_calls"]]
        text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
        return {"role": "assistant", "content": text}
    if message.get("role") == "tool":
        return {
            "role": "tool",
            "content": f"<tool_response>\n{message['content']}\n</tool_response>",
        }
    return message


def _call_block(function: dict[str, Any]) -> str:
    name = json.dumps(function["name"])
    return f'<tool_call>\n{{"name": {name}, "arguments": {function["arguments"]}}}\n</tool_call>'


# Most calls one forced answer may hold with `parallel_tool_calls`. Unbounded, a small model at
# temperature 1 kept appending calls until max_tokens: 7 of 100 forced calls on SmolLM2 ended
# "length" with no call (`python -m loadtest.structured --tool-calls 100`, 2026-11-30).
MAX_PARALLEL_CALLS = 4


def required_calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of the answer to `tool_choice: "required"`: an array of calls."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                "parameters": call_parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    max_items = MAX_PARALLEL_CALLS if parallel else 1
    return {"type": "array", "minItems": 1, "maxItems": max_items, "items": {"anyOf": calls}}


def named_call_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    """JSON schema of the named function's arguments, or None if no tool has that name."""
    for tool in tools:
        if tool["function"]["name"] == name:
            return call_parameters(tool)
    return None


def call_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A forced call's argument schema, closed as OpenAI's strict function calling is."""
    return close_objects(tool["function"].get("parameters") or {"type": "object", "properties": {}})

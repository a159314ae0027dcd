"""`tool_choice: "auto"`: free text, or a well-formed call once the model starts one.

One llguidance grammar per set of tools (cached by its text like any grammar):

- text that neither starts like a JSON call (`{`, a ```json fence then `{`) nor holds a
  `<tool_call>` tag is free, as without tools;
- a message that starts with `{` (after whitespace) must be one call to a declared tool,
  `{"name": ..., "arguments": ...}` (or Llama's `"parameters"`), then end; the same inside a
  ```json fence;
- after `<tool_call>` (any text before it), one call, `</tool_call>`, then only more blocks.

A call is the tool's parameters closed as in `required` (`close_objects`), numbers bounded
(`shared/json_numbers.py`). The parser (`api/openai/tool_calls.py`) reads all of these.
Used for the `hermes` and `json` formats, whose openers are text; the Llama, Mistral and
Phi-4 openers are special tokens, which a text grammar would forbid, so there `auto` stays
parse-only.
"""

from __future__ import annotations

import json
from typing import Any

from api.openai.tools import call_parameters
from shared.grammar import JSON_LAYOUT
from shared.json_numbers import bound_numbers

CONSTRAINED_FORMATS = ("hermes", "json")

_LARK = r"""
start: PLAIN | bare | fenced | tagged
PLAIN: /(?s:.*)/ & ~/[ \t\n]*(\{|```(json)?[ \t\n]*\{)(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/
bare: WS? call
fenced: WS? /```(json)?\n/ call "\n```"
tagged: head call "\n</tool_call>" more*
more: "\n<tool_call>\n" call "\n</tool_call>"
head[lazy]: HEAD "<tool_call>\n"
HEAD: /(?s:.*)/ & ~/[ \t\n]*(\{|```(json)?[ \t\n]*\{)(?s:.*)/
WS: /[ \t\n]+/
call: %json """


def auto_tools_lark(tools: list[dict[str, Any]]) -> str:
    """The Lark grammar (llguidance's dialect) of an `auto` answer for these tools."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, key: call_parameters(tool)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for tool in tools
        for key in ("arguments", "parameters")
    ]
    schema = bound_numbers({"anyOf": calls, "x-guidance": JSON_LAYOUT})
    return _LARK + json.dumps(schema)

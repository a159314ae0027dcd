"""Which tool-call syntax a model answers in, read once from its chat template.

The worker records it (`WorkerRecord.tool_format`, shown by `/v1/models`); the API reads
calls back in it (`api/openai/tool_calls.py`) and, under `tool_choice: "auto"`, constrains a
call once the model starts one (`api/openai/auto_tools.py`). Formats:

- `hermes`: `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks (Qwen2/2.5/3,
  Hermes, SmolLM3; also our fallback prompt for templates that take no `tools`);
- `llama3`: the whole answer is `{"name": ..., "parameters": ...}`, optionally after
  `<|python_tag|>` (Llama 3.1-3.3);
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]` (Mistral, Mixtral, Ministral);
- `phi4`: `<|tool_call|>[{"name": ..., "arguments": ...}]<|/tool_call|>` (Phi-4-mini);
- `json`: a template that takes `tools` with none of these markers: a bare JSON call.

Gemma 2/3 and Phi-3 templates take no `tools`, so they get the fallback prompt (`hermes`).
"""

from __future__ import annotations

from typing import Any, Literal

ToolFormat = Literal["hermes", "llama3", "mistral", "phi4", "json"]
TOOL_FORMATS: tuple[ToolFormat, ...] = ("hermes", "llama3", "mistral", "phi4", "json")

_PROBE_TOOL = {"type": "function", "function": {"name": "probe_tool_x", "parameters": {}}}
# (marker in the template, format), first match wins: Hermes tags before the Llama markers,
# as some templates (Hermes-3 on Llama 3.1) carry both.
_MARKERS: tuple[tuple[str, ToolFormat], ...] = (
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "phi4"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3"),
    ("ipython", "llama3"),
)


def template_takes_tools(render: Any) -> bool:
    """Whether `render(messages, tools=...)` (a chat_text) uses its `tools` argument."""
    messages = [{"role": "user", "content": "x"}]
    try:
        return render(messages, tools=[_PROBE_TOOL]) != render(messages)
    except ValueError:
        return False


def tool_format(chat_template: str | None, takes_tools: bool = True) -> ToolFormat:
    """The format a model answers calls in. A template that takes no `tools` gets our
    fallback prompt, which asks for Hermes blocks."""
    if not takes_tools:
        return "hermes"
    template = chat_template or ""
    for marker, name in _MARKERS:
        if marker in template:
            return name
    return "json"


def tokenizer_tool_format(tokenizer: Any) -> ToolFormat:
    """`tool_format` of a loaded `shared.tokenizer.Tokenizer` (renders the template once)."""
    render = getattr(tokenizer, "chat_text", None)  # test doubles may render no templates
    takes = render is not None and template_takes_tools(render)
    template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
    return tool_format(template if isinstance(template, str) else None, takes)

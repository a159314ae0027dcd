"""Tool calls in each family's syntax: the format read from a chat template, and `auto`
reading a message that is exactly a call (bare, fenced or tagged) as `tool_calls`."""

from __future__ import annotations

import json

import pytest

from api.openai.tool_calls import ToolCallParser, merge_deltas
from shared.contracts import ToolCallSpec
from shared.tool_format import tool_format

NAMES = ["get_weather", "get_time"]
ARGS = {"city": "Paris", "unit": "celsius"}
CALL = {"name": "get_weather", "arguments": ARGS}


@pytest.mark.parametrize(
    ("template", "takes_tools", "expected"),
    [
        ("{{ '<tool_call>' }}{{ tools }}", True, "hermes"),  # Qwen2.5, Hermes
        ("{{ '<|python_tag|>' }}{% if m.role == 'ipython' %}", True, "llama3"),  # Llama 3.1
        ("{% if message.role == 'ipython' %}{{ tools }}", True, "llama3"),  # Llama 3.2
        ("[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]", True, "mistral"),
        ("<|tool|>{{ tools }}<|/tool|><|tool_call|>", True, "phi4"),
        ("{{ tools | tojson }}", True, "json"),
        ("<start_of_turn>user", False, "hermes"),  # Gemma: our fallback prompt
        (None, False, "hermes"),
    ],
)
def test_the_format_comes_from_the_template(
    template: str | None, takes_tools: bool, expected: str
) -> None:
    assert tool_format(template, takes_tools) == expected


def _run(text: str, pieces: int, names: list[str] = NAMES) -> tuple[dict, list[dict]]:
    """The merged message and the streamed deltas for `text` fed in `pieces` chunks."""
    parser = ToolCallParser(ToolCallSpec(mode="auto", names=names), "job1", 0)
    size = max(1, -(-len(text) // pieces))
    deltas = [d for i in range(0, len(text), size) for d in parser.feed(text[i : i + size])]
    deltas += parser.finish()
    return merge_deltas(deltas), deltas


WHOLE_CALLS = [
    json.dumps(CALL),  # bare JSON (what a small Qwen answers under auto)
    "  " + json.dumps(CALL) + "\n",
    "```json\n" + json.dumps(CALL) + "\n```",  # fenced
    "```\n" + json.dumps(CALL) + "\n```",
    json.dumps({"name": "get_weather", "parameters": ARGS}),  # Llama 3
    "<|python_tag|>" + json.dumps({"name": "get_weather", "parameters": ARGS}),
    "[TOOL_CALLS]" + json.dumps([CALL]),  # Mistral
    json.dumps([CALL]),  # Mistral with [TOOL_CALLS] skipped by the detokenizer
    "<|tool_call|>" + json.dumps([CALL]) + "<|/tool_call|>",  # Phi-4-mini
    "functools" + json.dumps([CALL]),
    "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>",  # Hermes
    "<tool_call>" + json.dumps([CALL]) + "</tool_call>",  # SmolLM2's list in a tag
]


@pytest.mark.parametrize("text", WHOLE_CALLS)
@pytest.mark.parametrize("pieces", [1, 7, 200])
def test_a_message_that_is_exactly_a_call_is_a_call(text: str, pieces: int) -> None:
    message, deltas = _run(text, pieces)
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGS
    assert not any("content" in d and d["content"] for d in deltas)


def test_several_calls_in_one_message() -> None:
    second = {"name": "get_time", "arguments": {"zone": "CET"}}
    for text in (json.dumps([CALL, second]), json.dumps(CALL) + "; " + json.dumps(second)):
        message, _ = _run(text, 5)
        assert [c["function"]["name"] for c in message["tool_calls"]] == NAMES


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"name": "launch_rockets", "arguments": {}}),  # not a declared tool
        json.dumps({"city": "Paris"}),  # JSON, but not a call
        json.dumps(CALL) + " and then some text",
        "```json\n" + json.dumps({"a": 1}) + "\n```",
        "[1] first point, [2] second point",
        "The weather tool needs a city.",
    ],
)
def test_anything_else_is_text_unchanged(text: str) -> None:
    for pieces in (1, 9):
        message, _ = _run(text, pieces)
        assert message == {"role": "assistant", "content": text}


def test_plain_text_and_code_still_stream_as_they_come() -> None:
    parser = ToolCallParser(ToolCallSpec(mode="auto", names=NAMES), "job1", 0)
    assert parser.feed("Hello") == [{"content": "Hello"}]
    code = ToolCallParser(ToolCallSpec(mode="auto", names=NAMES), "job1", 0)
    assert code.feed("```js") == []  # may still become a fenced call
    assert code.feed("on\nprint(1)") == [{"content": "```json\nprint(1)"}]
    held = ToolCallParser(ToolCallSpec(mode="auto", names=NAMES), "job1", 0)
    assert held.feed('{"name": "get_weather", ') == []  # held until the message ends


def test_text_then_hermes_blocks_streams_the_text_first() -> None:
    text = "Let me check.\n<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"
    message, deltas = _run(text, 10)
    assert deltas[0] == {"content": "Let me check"}  # the first piece, sent before the call
    assert message["content"] == "Let me check."
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == ARGS


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius"]}},
            "required": ["city"],
        },
    },
}
BLOCK = "<tool_call>\n" + json.dumps(CALL) + "\n</tool_call>"


@pytest.fixture(scope="module")
def auto_grammar_accepts(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    from api.openai.auto_tools import auto_tools_lark
    from shared.grammar import build_grammar
    from tests.support.grammar_accepts import byte_acceptor

    accepts = byte_acceptor(tmp_path_factory.mktemp("bytes"))
    grammar = build_grammar("grammar", auto_tools_lark([TOOL]))
    return lambda text: accepts(grammar, text)


@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("The weather tool needs a city.", True),  # text is free
        ("```python\nprint({1: 2})\n```", True),
        ("a { b } <tool_ c", True),
        (json.dumps(CALL), True),  # a started call must be a well-formed call
        ("\n" + json.dumps({"name": "get_weather", "parameters": ARGS}), True),
        ("```json\n" + json.dumps(CALL) + "\n```", True),
        ("Let me check.\n" + BLOCK, True),
        (BLOCK + "\n" + BLOCK, True),
        (json.dumps({"city": "Paris"}), False),  # JSON that is not a call
        (json.dumps({"name": "launch", "arguments": {}}), False),  # an undeclared tool
        ('{"name": "get_weather", "arguments": {"city": "Paris", "extra": 1}}', False),
        ("```json\n" + json.dumps({"a": 1}), False),
        ("<tool_call>\n" + json.dumps({"name": "get_weather"}), False),
        (BLOCK + " and some text", False),  # only more calls after a call
        ('{"name": "get_weather", "arguments": {"city": "P", "unit": "kelvin"}}', False),
    ],
)
def test_auto_constrains_a_call_once_started(
    auto_grammar_accepts, text: str, allowed: bool
) -> None:
    assert auto_grammar_accepts(text) is allowed

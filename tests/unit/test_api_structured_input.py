"""Structured outputs, tools and OpenAI fields Ladle does not implement: one table of 400s
(param named, nothing enqueued), and what a valid request puts in the job."""

from __future__ import annotations

import pytest

from tests.unit.api_harness import harness
from tests.unit.fake_worker import TOKENIZER
from tests.unit.test_api_bad_input import CHAT, CMPL, JOBS, Case, _chat, _cmpl, _job
from tests.unit.test_api_bad_input import test_bad_input_is_4xx_with_openai_error as check

pytestmark = pytest.mark.redis

UNSUPPORTED = "unsupported_parameter"
SCHEMA_ERR = "invalid_schema"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "strange"}}}


def _fmt(schema: object) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


CASES = [
    # OpenAI fields not implemented: 400 naming them unless they ask for nothing.
    *[
        Case(f"unsupported-{name}", CHAT, _chat(**{name: value}), param=name, code=UNSUPPORTED)
        for name, value in [
            ("audio", {"voice": "alloy", "format": "wav"}),
            ("modalities", ["text", "audio"]),
            ("prediction", {"type": "content", "content": "x"}),
            ("web_search_options", {}),
            ("functions", [{"name": "f"}]),
            ("function_call", "auto"),
            ("reasoning_effort", "high"),
            ("verbosity", "low"),
            ("store", True),
            ("service_tier", "flex"),
        ]
    ],
    Case("best-of-above-n", CMPL, _cmpl(best_of=3), param="best_of", code=UNSUPPORTED),
    Case("best-of-below-n", CMPL, _cmpl(best_of=1, n=2), param="best_of"),
    Case("best-of-zero", CMPL, _cmpl(best_of=0), param="best_of"),
    # response_format
    Case(
        "format-type-unknown",
        CHAT,
        _chat(response_format={"type": "xml"}),
        param="response_format.type",
    ),
    Case(
        "format-schema-missing",
        CHAT,
        _chat(response_format={"type": "json_schema"}),
        param="response_format",
    ),
    Case(
        "format-schema-invalid",
        CHAT,
        _chat(response_format=_fmt(BAD_SCHEMA)),
        param="response_format.json_schema.schema",
        code=SCHEMA_ERR,
    ),
    Case(
        "format-schema-not-object",
        CHAT,
        _chat(response_format=_fmt([1, 2])),
        param="response_format.json_schema.schema",
    ),
    Case(
        "format-bad-name",
        CHAT,
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "a b"}}),
        param="response_format.json_schema.name",
    ),
    Case(
        "format-on-completions",
        CMPL,
        _cmpl(response_format=_fmt(BAD_SCHEMA)),
        param="response_format.json_schema.schema",
        code=SCHEMA_ERR,
    ),
    # vLLM's structured_outputs
    Case("so-none-given", CHAT, _chat(structured_outputs={}), param="structured_outputs"),
    Case(
        "so-two-given",
        CHAT,
        _chat(structured_outputs={"regex": "a+", "choice": ["a"]}),
        param="structured_outputs",
    ),
    Case(
        "so-bad-regex",
        CMPL,
        _cmpl(structured_outputs={"regex": "[a-"}),
        param="structured_outputs.regex",
        code=SCHEMA_ERR,
    ),
    Case(
        "so-bad-grammar",
        CMPL,
        _cmpl(structured_outputs={"grammar": "start: undefined_rule"}),
        param="structured_outputs.grammar",
        code=SCHEMA_ERR,
    ),
    Case(
        "so-json-not-json",
        CMPL,
        _cmpl(structured_outputs={"json": "{nope"}),
        param="structured_outputs.json",
        code=SCHEMA_ERR,
    ),
    Case(
        "so-choice-empty-strings",
        CMPL,
        _cmpl(structured_outputs={"choice": [1, 2]}),
        param="structured_outputs.choice.0",
    ),
    Case(
        "so-and-format",
        CHAT,
        _chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
        param="structured_outputs",
    ),
    # tools and tool_choice
    Case("tools-not-list", CHAT, _chat(tools={"a": 1}), param="tools"),
    Case("tool-type", CHAT, _chat(tools=[{**TOOL, "type": "web"}]), param="tools.0.type"),
    Case(
        "tool-name",
        CHAT,
        _chat(tools=[{"type": "function", "function": {"name": "a b"}}]),
        param="tools.0.function.name",
    ),
    Case("choice-without-tools", CHAT, _chat(tool_choice="required"), param="tool_choice"),
    Case("choice-unknown", CHAT, _chat(tools=[TOOL], tool_choice="sometimes"), param="tool_choice"),
    Case(
        "choice-names-missing-tool",
        CHAT,
        _chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        param="tool_choice",
    ),
    Case(
        "tool-bad-parameters",
        CHAT,
        _chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
            tool_choice="required",
        ),
        param="tools",
        code=SCHEMA_ERR,
    ),
    Case(
        "forced-tool-and-format",
        CHAT,
        _chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        param="response_format",
    ),
    Case(
        "tool-call-bad-history",
        CHAT,
        _chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]),
        param="messages.0.tool_calls.0.function.name",
    ),
    Case(
        "job-bad-schema",
        JOBS,
        _job(_chat(response_format=_fmt(BAD_SCHEMA)), "/v1/chat/completions"),
        param="response_format.json_schema.schema",
        code=SCHEMA_ERR,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_structured_bad_input_is_a_400_naming_the_parameter(case: Case) -> None:
    await check(case)


async def test_valid_requests_put_grammar_and_tool_spec_in_the_job() -> None:
    async with harness() as h:
        await h.worker.register(max_model_len=4096)  # room for the fallback tools prompt
        body = _chat(response_format=_fmt({"type": "object"}), store=False, vendor_x=1)
        assert (await h.client.post(CHAT, json=body)).status_code == 200
        body = _chat(tools=[TOOL], tool_choice="required", parallel_tool_calls=False)
        r = await h.client.post(CHAT, json=body)
        assert r.status_code == 200, r.text
        body = _cmpl(structured_outputs={"choice": ["yes", "no"]}, best_of=1)
        assert (await h.client.post(CMPL, json=body)).status_code == 200
        first, second, third = h.worker.payloads[-3:]
        assert first.structured.kind == "json_schema" and first.tool_calls is None
        assert second.structured.kind == "tool_calls" and second.structured.param == "tools"
        assert second.tool_calls.mode == "required"
        assert '"maxItems":1' in second.structured.grammar.replace(" ", "")
        assert third.structured.kind == "choice"


async def test_a_list_of_prompts_gets_n_choices_each_in_openai_order() -> None:
    async with harness() as h:
        body = _cmpl(prompt=["ab", "xyz"], n=2, echo=True)
        r = await h.client.post(CMPL, json=body)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        payload = h.worker.payloads[-1]
        assert payload.prompts == [TOKENIZER.encode("ab"), TOKENIZER.encode("xyz")]
        assert payload.num_choices == 4
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        echoes = ["ab", "ab", "xyz", "xyz"]
        assert [c["text"] for c in choices] == [e + f"Hi {i}!" for i, e in enumerate(echoes)]

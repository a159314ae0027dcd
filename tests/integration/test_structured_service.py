"""Structured outputs and tools through the real service (API + worker + Redis), with the
official openai client: a tiny random Qwen2 whose byte-level tokenizer can spell anything
and whose Qwen2.5-style template takes tools. Temperature 1.0 throughout: validity comes
from the grammar, not from the model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from shared.tokenizer import load_tokenizer
from tests.support.harness import Service, start_service
from tests.support.tiny_bytes import tiny_byte_model_dir

SCHEMAS = json.loads((Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
USER = [{"role": "user", "content": "Answer."}]
# Tools shared with loadtest.structured. Their integers are bounded: an unbounded one lets a
# model at temperature 1 emit digits until max_tokens ("length"), for any grammar engine.
TOOLS = json.loads((Path(__file__).parents[1] / "data" / "tools.json").read_text())
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Soup(BaseModel):
    name: str = Field(max_length=20)
    servings: int = Field(ge=1, le=8)
    vegetarian: bool


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_byte_model_dir("qwen2", tmp_path_factory.mktemp("byte-service"), seed=3)


@pytest.fixture(scope="module")
def svc(byte_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = start_service(byte_model, tmp_path_factory.mktemp("logs"), max_model_len=2048)
    yield service
    service.stop()


@pytest.fixture(scope="module")
def client(svc: Service) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{svc.base_url}/v1", api_key="unused", max_retries=0)


def test_openai_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=model, messages=USER, response_format=Soup, temperature=1.0, seed=seed
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Soup)


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "sse"])
def test_every_schema_validates_streaming_and_not(client: openai.OpenAI, stream: bool) -> None:
    model = client.models.list().data[0].id
    for case in SCHEMAS:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": case["schema"]}}
        kwargs = dict(model=model, messages=USER, temperature=1.0, max_tokens=400)
        if stream:
            chunks = client.chat.completions.create(**kwargs, response_format=fmt, stream=True)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(**kwargs, response_format=fmt)
            text = text.choices[0].message.content
        jsonschema.validate(json.loads(text), case["schema"], format_checker=CHECKER)


def _check_calls(calls: list, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "sse"])
def test_required_and_named_tool_choice_always_valid(client: openai.OpenAI, stream: bool) -> None:
    model = client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    for i, choice in enumerate(["required", named] * 5):
        kwargs = dict(model=model, messages=USER, tools=TOOLS, tool_choice=choice, seed=i)
        if stream:
            calls = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
            finish = calls.pop()
        else:
            response = client.chat.completions.create(**kwargs, parallel_tool_calls=i % 4 != 0)
            calls, finish = (
                response.choices[0].message.tool_calls,
                response.choices[0].finish_reason,
            )
        assert finish == "tool_calls"
        _check_calls(calls, {"get_weather"} if choice is named else set(PARAMS))


def _streamed_calls(chunks: object) -> list:
    """Tool calls assembled from deltas (id and name once, arguments in pieces); the last
    element is the finish reason."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:  # type: ignore[attr-defined]
        choice = chunk.choices[0]
        for piece in choice.delta.tool_calls or []:
            if piece.id:
                assert piece.index not in calls
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "args": ""}
            calls[piece.index]["args"] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    out: list = [
        openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["args"]}
        )
        for c in calls.values()
    ]
    return [*out, finish]


# The tiny random model never calls a tool on its own: a regex makes it answer a Hermes
# <tool_call> block, which `auto` must then read out of free text like any model's.
HERMES = (
    r'Let me check\.\n<tool_call>\n\{"name": "get_weather", '
    r'"arguments": \{"city": "Oslo", "unit": "celsius"\}\}\n</tool_call>'
)


def test_auto_tool_call_round_trip_sync_sse_and_job_api(
    client: openai.OpenAI, svc: Service, byte_model: Path
) -> None:
    model = client.models.list().data[0].id
    body = dict(model=model, messages=USER, tools=TOOLS, tool_choice="auto")
    extra = {"structured_outputs": {"regex": HERMES}}
    response = client.chat.completions.create(**body, extra_body=extra)
    message = response.choices[0].message
    assert response.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    [call] = message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo", "unit": "celsius"},
    )
    streamed = _streamed_calls(
        client.chat.completions.create(**body, extra_body=extra, stream=True)
    )
    assert streamed[-1] == "tool_calls"
    assert streamed[0].function.arguments == call.function.arguments

    history = [
        *USER,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'},
    ]
    follow = client.chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=4
    )
    rendered = load_tokenizer(str(byte_model)).apply_chat_template(
        [*USER, {**message.model_dump(exclude_none=True), "content": "Let me check."}, history[2]],
        tools=TOOLS,
    )
    assert follow.usage.prompt_tokens == len(rendered)

    job = {"url": "/v1/chat/completions", "body": {**body, **extra}}
    with httpx.Client(base_url=svc.base_url, timeout=60) as http:
        job_id = http.post("/v1/jobs", json=job).json()["id"]
        record = _wait_job(http, job_id)
    job_message = record["response"]["choices"][0]["message"]
    assert job_message["tool_calls"][0]["function"] == call.function.model_dump()
    assert record["response"]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["sync", "sse"])
def test_auto_makes_a_started_call_well_formed(
    client: openai.OpenAI, byte_model: Path, stream: bool
) -> None:
    """Under auto, a message that starts with `{` must become a call to a declared tool:
    a bias makes the random model start (and keep writing `{` wherever JSON allows it)."""
    listed = client.models.list().data[0]
    assert listed.tool_format == "hermes"  # read from the template at load
    model = listed.id
    [brace] = load_tokenizer(str(byte_model)).encode("{", add_special_tokens=False)
    body = dict(model=model, messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=200)
    for seed in range(3):
        kwargs = dict(**body, seed=seed, logit_bias={str(brace): 100})
        if stream:
            calls = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
            finish = calls.pop()
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert finish == "tool_calls"
        _check_calls(calls, set(PARAMS))


def _wait_job(http: httpx.Client, job_id: str) -> dict:
    with http.stream("GET", f"/v1/jobs/{job_id}/events") as events:
        for line in events.iter_lines():
            if line.startswith("event: done") or line.startswith("event: error"):
                break
    return http.get(f"/v1/jobs/{job_id}").json()


def test_a_list_of_prompts_through_the_service(client: openai.OpenAI) -> None:
    """One choice per prompt x n, index prompt * n + j, each as the prompt alone gives."""
    model = client.models.list().data[0].id
    prompts = ["Soup is", "A ladle"]
    kwargs = dict(model=model, max_tokens=5, temperature=0, n=2)
    both = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for number, prompt in enumerate(prompts):
        alone = client.completions.create(prompt=prompt, **kwargs)
        texts = [c.text for c in both.choices[2 * number : 2 * number + 2]]
        assert texts == [c.text for c in alone.choices]
    assert both.usage.prompt_tokens == sum(
        client.completions.create(prompt=p, model=model, max_tokens=1).usage.prompt_tokens
        for p in prompts
    )


def test_langchain_structured_output_and_bind_tools(svc: Service, client: openai.OpenAI) -> None:
    from langchain_openai import ChatOpenAI

    model = client.models.list().data[0].id
    llm = ChatOpenAI(base_url=f"{svc.base_url}/v1", api_key="unused", model=model, temperature=1)
    soup = llm.with_structured_output(Soup).invoke("Describe a soup.")
    assert isinstance(soup, Soup)
    bound = llm.bind_tools([TOOLS[0]], tool_choice="get_weather")
    [call] = bound.invoke("Weather in Oslo?").tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], PARAMS["get_weather"])

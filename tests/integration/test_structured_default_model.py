"""The default model (SmolLM2-135M-Instruct) through the service at temperature 1.0: every
kept schema parses and validates, streamed and not, and forced tool calls match their
parameter schemas. The 200-generation version is `python -m loadtest.structured`
(figures in docs/benchmarks.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.integration.test_structured_service import PARAMS, SCHEMAS, TOOLS, USER
from tests.support.harness import Service, start_service

pytestmark = pytest.mark.slow
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    service: Service = start_service(
        Path("SmolLM2-135M-Instruct"),
        tmp_path_factory.mktemp("logs"),
        num_threads=2,
        kv_cache_size_mb=64,
        dtype="auto",
    )
    try:
        yield openai.OpenAI(base_url=f"{service.base_url}/v1", api_key="x", max_retries=0)
    finally:
        service.stop()


def _json_answer(client: openai.OpenAI, case: dict, stream: bool) -> str:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": case["schema"]}}
    kwargs = dict(
        model="SmolLM2-135M-Instruct",
        messages=USER,
        response_format=fmt,
        temperature=1.0,
        max_tokens=400,
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].message.content or ""
    chunks = client.chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_every_schema_validates_on_the_default_model(client: openai.OpenAI) -> None:
    jobs = [(case, False) for case in SCHEMAS] + [(case, True) for case in SCHEMAS[::3]]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _json_answer(client, *job), jobs))
    for (case, _stream), text in zip(jobs, answers, strict=True):
        jsonschema.validate(json.loads(text), case["schema"], format_checker=CHECKER)


def test_forced_tool_calls_match_their_schemas_on_the_default_model(
    client: openai.OpenAI,
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}

    def call(i: int) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
            tools=TOOLS,
            tool_choice="required" if i % 2 else named,
            parallel_tool_calls=i % 4 != 1,
            temperature=1.0,
            max_tokens=300,
        )

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(call, range(8)))
    for response in responses:
        assert response.choices[0].finish_reason == "tool_calls", response.choices[0].message
        for tool_call in response.choices[0].message.tool_calls or []:
            arguments = json.loads(tool_call.function.arguments)
            jsonschema.validate(arguments, PARAMS[tool_call.function.name])
        assert response.choices[0].message.tool_calls

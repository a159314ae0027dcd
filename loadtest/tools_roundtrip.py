"""Tool calls round-tripped through the official openai client, on real instruct models.

    python -m loadtest.tools_roundtrip                          # the default model
    python -m loadtest.tools_roundtrip --model /path/a.gguf --model /path/b.gguf
    python -m loadtest.tools_roundtrip --base-url http://127.0.0.1:8000/v1

For each model: `ladle up` on a spare port with a private Redis, then for each mode
(`tool_choice` "auto", "required") the same three weather questions, greedy, each asked
non-streamed and streamed. A call is right when it names `get_weather`, its arguments
validate against the tool's schema and name the asked city, and finish_reason is
"tool_calls" (streamed: the same call assembled from the deltas). Each right call is then
answered with a `tool` message and the conversation sent back (the round trip): the reply
must be a 200 with an assistant message. Prints JSON: per model and mode, right x/3 (sync
and SSE), the raw answers of the misses, the model's tool format (`/v1/models`), load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
QUESTIONS = [
    ("What is the weather in Paris right now?", "paris"),
    ("Is it cold in Oslo today? Answer in celsius.", "oslo"),
    ("Tell me the current weather in Tokyo.", "tokyo"),
]


def check_call(calls: list[dict[str, Any]], finish: str | None, city: str) -> str:
    """'' when right, else why not."""
    if finish != "tool_calls" or not calls:
        return f"finish_reason {finish!r}, {len(calls)} calls"
    call = calls[0]
    if call["name"] != "get_weather":
        return f"called {call['name']!r}"
    try:
        args = json.loads(call["arguments"])
        jsonschema.validate(args, WEATHER["function"]["parameters"])
    except (ValueError, jsonschema.ValidationError) as exc:
        return f"bad arguments {call['arguments']!r}: {str(exc)[:80]}"
    if city not in str(args.get("city", "")).lower():
        return f"city {args.get('city')!r}"
    return ""


def ask(client: Any, model: str, mode: str, question: str, stream: bool) -> dict[str, Any]:
    """One question: the calls (name, arguments, id), finish_reason and the text."""
    messages = [{"role": "user", "content": question}]
    body = dict(model=model, messages=messages, tools=TOOLS, tool_choice=mode, temperature=0)
    body["max_tokens"] = 120
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return {"calls": calls, "finish": choice.finish_reason, "text": choice.message.content}
    calls_by_index: dict[int, dict[str, Any]] = {}
    text, finish = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        text += delta.content or ""
        for piece in delta.tool_calls or []:
            entry = calls_by_index.setdefault(piece.index, {"id": piece.id, "arguments": ""})
            if piece.function.name:
                entry["name"] = piece.function.name
            entry["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"calls": list(calls_by_index.values()), "finish": finish, "text": text or None}


def round_trip(client: Any, model: str, question: str, call: dict[str, Any]) -> bool:
    """Send the call and a tool result back; the model must answer with a message."""
    messages = [
        {"role": "user", "content": question},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": '{"temperature_c": 7}'},
    ]
    reply = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=40
    )
    return reply.choices[0].message.role == "assistant"


def run_model(base_url: str) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    listed = client.models.list().data[0]
    model = listed.id
    result: dict[str, Any] = {"model": model, "tool_format": getattr(listed, "tool_format", None)}
    for mode in ("auto", "required"):
        for stream in (False, True):
            right, round_trips, misses = 0, 0, []
            for question, city in QUESTIONS:
                answer = ask(client, model, mode, question, stream)
                why = check_call(answer["calls"], answer["finish"], city)
                if why:
                    misses.append({"question": question, "why": why, "answer": answer})
                    continue
                right += 1
                round_trips += round_trip(client, model, question, answer["calls"][0])
            key = f"{mode}_{'sse' if stream else 'sync'}"
            result[key] = {"right": f"{right}/3", "round_trips": round_trips, "misses": misses}
    return result


@contextlib.contextmanager
def service(model: str | None) -> Iterator[str]:
    from loadtest.bench_serve import running_service

    with running_service(model=model, ready_timeout_s=1200.0) as base_url:
        yield base_url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="LLM_MODEL_NAME (repeat; default: ours)")
    parser.add_argument("--base-url", help="a running service's /v1 URL (else start one)")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"cpu": platform.processor(), "load_before": os.getloadavg()}
    runs = []
    if args.base_url:
        runs.append(run_model(args.base_url))
    for model in args.model or ([] if args.base_url else [None]):
        with service(model) as base_url:
            runs.append(run_model(base_url))
    report["runs"] = runs
    report["load_after"] = os.getloadavg()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

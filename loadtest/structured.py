"""Structured outputs through the service: validity, throughput under load, compile cost.

    python -m loadtest.structured                       # starts `ladle up` (default model)
    python -m loadtest.structured --base-url http://127.0.0.1:8000/v1

One run, one service, four parts:
1. validity: `--generations` chat requests at temperature 1.0 cycling over the schemas in
   tests/data/json_schemas.json, half streamed, at `--concurrency`; every answer must parse
   and validate (jsonschema, formats checked);
2. throughput: `--requests` requests at `--concurrency`, unconstrained, then each with its
   own new json_schema (one required string of >= 400 characters, so every request yields
   exactly `--max-tokens` tokens), alternated `--rounds` times and ending unconstrained;
   median output tokens/s of the constrained arms over that of the unconstrained ones;
3. forced tool calls: `--tool-calls` chat requests at temperature 1.0 with the tools in
   tests/data/tools.json, `tool_choice` alternating "required" and a named function; every
   call must end with finish_reason "tool_calls" and arguments valid against its schema;
4. compile cost: one request at a time, interleaved: unconstrained, a schema never seen
   (compiled in API and worker), the same schema again (cached); median TTFT of each; and,
   in this process, the grammar path alone (API check + worker matcher), first and cached,
   which a loaded machine's TTFT noise cannot resolve to the millisecond.
Prints JSON with the figures, `uptime` load, the CPU model and the command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import jsonschema

SCHEMAS = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json").read_text()
)
CHECKER = jsonschema.Draft202012Validator.FORMAT_CHECKER
MESSAGES = [{"role": "user", "content": "Fill in the requested JSON about a soup recipe."}]
TOOLS = json.loads(
    (Path(__file__).resolve().parent.parent / "tests" / "data" / "tools.json").read_text()
)
PARAMS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


def _format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


async def chat(
    http: httpx.AsyncClient, model: str, stream: bool, **body: Any
) -> tuple[str, int, float]:
    """(text, completion tokens, seconds to the first content) of one chat request."""
    payload = {"model": model, "messages": MESSAGES, "stream": stream, **body}
    started = time.perf_counter()
    if not stream:
        response = (await http.post("/chat/completions", json=payload)).json()
        elapsed = time.perf_counter() - started
        text = response["choices"][0]["message"]["content"]
        return text, response["usage"]["completion_tokens"], elapsed
    payload["stream_options"] = {"include_usage": True}
    text, tokens, first = "", 0, None
    async with http.stream("POST", "/chat/completions", json=payload) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece and first is None:
                    first = time.perf_counter() - started
                text += piece or ""
    return text, tokens, first if first is not None else time.perf_counter() - started


async def bounded(concurrency: int, jobs: list) -> list:
    """Run coroutine factories with at most `concurrency` in flight, results in order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(job: Any) -> Any:
        async with gate:
            return await job()

    return await asyncio.gather(*(one(job) for job in jobs))


async def validity(http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> dict:
    def job(i: int) -> Any:
        case = SCHEMAS[i % len(SCHEMAS)]
        body = dict(response_format=_format(case["schema"]), temperature=1.0, max_tokens=400)
        return lambda: chat(http, model, i % 2 == 1, **body)

    results = await bounded(args.concurrency, [job(i) for i in range(args.generations)])
    counts = {"sync": [0, 0], "sse": [0, 0]}
    failures = []
    for i, (text, _tokens, _ttft) in enumerate(results):
        kind = "sse" if i % 2 else "sync"
        counts[kind][1] += 1
        case = SCHEMAS[i % len(SCHEMAS)]
        try:
            jsonschema.validate(json.loads(text), case["schema"], format_checker=CHECKER)
            counts[kind][0] += 1
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"schema": case["name"], "text": text[:200], "error": str(exc)[:200]})
    return {"valid": {k: f"{ok}/{n}" for k, (ok, n) in counts.items()}, "failures": failures[:5]}


async def tool_call(http: httpx.AsyncClient, model: str, i: int) -> str | None:
    """None when request i's forced tool calls are all valid, else what is wrong."""
    named = {"type": "function", "function": {"name": TOOLS[i % len(TOOLS)]["function"]["name"]}}
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the weather in Oslo, or 2 + 3?"}],
        "tools": TOOLS,
        "tool_choice": "required" if i % 2 else named,
        "parallel_tool_calls": i % 4 != 1,
        "temperature": 1.0,
        "max_tokens": 300,
    }
    choice = (await http.post("/chat/completions", json=body)).json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] != "tool_calls" or not calls:
        return f"finish_reason {choice['finish_reason']}, {len(calls)} calls"
    try:
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, PARAMS[call["function"]["name"]])
    except (ValueError, KeyError, jsonschema.ValidationError) as exc:
        return str(exc)[:200]
    return None


async def tool_calls(http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> dict:
    jobs = [lambda i=i: tool_call(http, model, i) for i in range(args.tool_calls)]
    problems = [p for p in await bounded(args.concurrency, jobs) if p is not None]
    num_valid = args.tool_calls - len(problems)
    return {"valid": f"{num_valid}/{args.tool_calls}", "failures": problems[:5]}


def long_schema() -> dict:
    """A schema no request has used, that cannot finish within a few hundred tokens."""
    name = f"notes_{uuid.uuid4().hex[:8]}"
    return {
        "type": "object",
        "properties": {name: {"type": "string", "minLength": 400}},
        "required": [name],
    }


async def throughput_arm(
    http: httpx.AsyncClient, model: str, args: argparse.Namespace, constrained: bool
) -> float:
    def job() -> Any:
        body: dict[str, Any] = dict(max_tokens=args.max_tokens, temperature=1.0)
        if constrained:
            body["response_format"] = _format(long_schema())
        else:
            body["ignore_eos"] = True
        return lambda: chat(http, model, True, **body)

    started = time.perf_counter()
    results = await bounded(args.concurrency, [job() for _ in range(args.requests)])
    elapsed = time.perf_counter() - started
    return sum(tokens for _text, tokens, _ttft in results) / elapsed


async def throughput(http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> dict:
    """Unconstrained and constrained arms alternated (A B A B ... A), so load that drifts
    during the run (a shared machine) falls on both; the ratio is of the arms' medians."""
    plain, constrained = [], []
    for _ in range(args.rounds):
        plain.append(await throughput_arm(http, model, args, constrained=False))
        constrained.append(await throughput_arm(http, model, args, constrained=True))
    plain.append(await throughput_arm(http, model, args, constrained=False))
    return {
        "concurrency": args.concurrency,
        "unconstrained_tok_s": [round(v, 1) for v in plain],
        "distinct_schemas_tok_s": [round(v, 1) for v in constrained],
        "ratio_of_medians": round(statistics.median(constrained) / statistics.median(plain), 3),
    }


async def compile_cost(http: httpx.AsyncClient, model: str, args: argparse.Namespace) -> dict:
    ttft: dict[str, list[float]] = {"plain": [], "new_schema": [], "cached_schema": []}
    cached = _format(SCHEMAS[19]["schema"])
    await chat(http, model, True, max_tokens=2, response_format=cached)  # compile it once
    for _ in range(args.ttft_samples):
        recipe = json.loads(json.dumps(SCHEMAS[19]["schema"]))
        recipe["properties"][f"extra_{uuid.uuid4().hex[:8]}"] = {"type": "boolean"}
        for kind, fmt in (
            ("plain", None),
            ("new_schema", _format(recipe)),
            ("cached_schema", cached),
        ):
            body: dict[str, Any] = dict(max_tokens=2, temperature=1.0)
            if fmt:
                body["response_format"] = fmt
            ttft[kind].append((await chat(http, model, True, **body))[2] * 1000)
    medians = {kind: round(statistics.median(values), 1) for kind, values in ttft.items()}
    return {
        "ttft_ms_median": medians,
        "added_ms_new_schema": round(medians["new_schema"] - medians["plain"], 1),
        "added_ms_cached_schema": round(medians["cached_schema"] - medians["plain"], 1),
        "samples": args.ttft_samples,
    }


def compile_path(model: str) -> dict:
    """What a request's grammar costs on its path, in this process, without the noise of a
    loaded machine's TTFT: the API's build-and-check plus the worker's matcher, for a schema
    never seen (each of the kept schemas, made unique) and for one seen before (cached)."""
    from shared.grammar import build_grammar
    from shared.tokenizer import load_tokenizer
    from worker.engine.grammar_matcher import GrammarCompiler

    tokenizer = load_tokenizer(model)
    compiler = GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)
    compiler.matcher(build_grammar("json_object", None))  # waits for llguidance's tokenizer
    first, cached = [], []
    for case in SCHEMAS:
        schema = {**case["schema"], "title": uuid.uuid4().hex}
        for into in (first, cached):
            started = time.perf_counter()
            compiler.matcher(build_grammar("json_schema", schema))
            into.append((time.perf_counter() - started) * 1000)
    return {
        "first_ms_median": round(statistics.median(first), 2),
        "first_ms_max": round(max(first), 2),
        "cached_ms_median": round(statistics.median(cached), 3),
        "cached_ms_max": round(max(cached), 3),
        "schemas": len(SCHEMAS),
    }


async def run(base_url: str, args: argparse.Namespace) -> dict:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        model = (await http.get("/models")).json()["data"][0]["id"]
        report: dict[str, Any] = {"model": model}
        if args.ttft_samples:
            report["compile"] = await compile_cost(http, model, args)
        if args.requests:
            report["throughput"] = await throughput(http, model, args)
        if args.generations:
            report["validity"] = await validity(http, model, args)
        if args.tool_calls:
            report["tool_calls"] = await tool_calls(http, model, args)
    return report


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(
            (
                line.split(":", 1)[1].strip()
                for line in lscpu.splitlines()
                if line.startswith("Model name")
            ),
            "",
        )
    return {"cpu": cpu or platform.processor(), "load_avg": os.getloadavg(), "command": sys.argv}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running service's /v1 URL (else start one)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--generations", type=int, default=200)
    parser.add_argument("--tool-calls", type=int, default=100, help="forced tool calls")
    parser.add_argument("--requests", type=int, default=32, help="per throughput arm (0: skip)")
    parser.add_argument("--rounds", type=int, default=1, help="constrained arms (A B ... A)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ttft-samples", type=int, default=20, help="0: skip")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="for compile_path")
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    report: dict[str, Any] = {"machine_before": machine()}
    report["compile_path"] = compile_path(args.model)
    if args.base_url:
        report.update(asyncio.run(run(args.base_url, args)))
    else:
        from loadtest.bench_serve import running_service

        with running_service() as base_url:
            report.update(asyncio.run(run(base_url, args)))
    report["load_after"] = os.getloadavg()
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

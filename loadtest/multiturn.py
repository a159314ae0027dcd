"""Multi-turn chat on several workers, with and without cache-aware routing.

    python -m loadtest.multiturn                       # 32 conversations x 6 turns, 2 workers
    python -m loadtest.multiturn --routing off --conversations 4 --turns 3   # a quick look

Each conversation is a shared system prompt and its own user turns; turn k sends the whole
history (every earlier question and the model's answers) plus a new question, streamed from
/v1/chat/completions, greedy. `--concurrency` conversations run at once, each turn after the
previous answer (and `--think-s`, a user's pause, if given). Per run (`ladle up --workers N`,
its own Redis, LLM_PREFIX_ROUTING on or off):
- prefix hit rate of turns 2+: cached prompt tokens (usage.prompt_tokens_details) over the
  possible ones: the prompt's leading full blocks shared with the previous turn's prompt and
  answer as the API tokenizes them (a worker that kept everything would hit those);
- median and p90 TTFT of turn 1 and of turns 2+, and how many jobs were routed;
- the median of each phase of turns 2+ from the jobs' own timings: queue (queued -> a worker
  took it), setup, engine queue (-> first scheduled) and prefill (-> first token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.bench_serve import running_service

BLOCK_SIZE = 16
WORDS = (
    "river stone lamp garden market winter copper signal harbor meadow engine letter violin "
    "thunder basket silver orchard canyon lantern pepper island marble feather compass rocket "
    "velvet glacier saddle pillow candle ladder tunnel falcon mirror cotton walnut anchor"
).split()
SYSTEM = (
    "You are a careful assistant for a travel company. Answer in short plain sentences, "
    "keep the customer's earlier details in mind, never invent prices, and say when you do "
    "not know. The company runs trains, ferries and bus tours across twelve countries; "
    "bookings change up to two days before departure; refunds take five working days; "
    "children under four travel free; pets ride in carriers on trains and ferries only. "
) * 2


@dataclass
class Turn:
    conversation: int
    turn: int
    messages: list[dict[str, str]]
    answer: str = ""
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    job_id: str = ""
    error: str | None = None
    possible_tokens: int = 0
    worker_id: str | None = None
    routed_to: str | None = None
    phases_s: dict[str, float] = field(default_factory=dict)  # the job's own timings


@dataclass
class RunResult:
    routing: bool
    turns: list[Turn] = field(default_factory=list)
    duration_s: float = 0.0


def question(rng: random.Random, num_words: int) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(num_words))
    return f"My trip notes: {words}. What should I book next?"


async def chat_turn(http: httpx.AsyncClient, model: str, turn: Turn, max_tokens: int) -> None:
    body = {
        "model": model,
        "messages": turn.messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    parts: list[str] = []
    async with http.stream("POST", "/chat/completions", json=body) as response:
        turn.job_id = response.headers.get("X-Job-Id", "")
        if response.status_code != 200:
            turn.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                turn.error = str(chunk["error"])
                return
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") or ""
                if text and not turn.ttft_s:
                    turn.ttft_s = time.perf_counter() - started
                parts.append(text)
            if chunk.get("usage"):
                usage = chunk["usage"]
                turn.prompt_tokens = usage["prompt_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                turn.cached_tokens = details.get("cached_tokens") or 0
    turn.answer = "".join(parts)


async def conversation(
    http: httpx.AsyncClient, model: str, index: int, args: argparse.Namespace
) -> list[Turn]:
    rng = random.Random(index)
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    for number in range(1, args.turns + 1):
        messages = [*messages, {"role": "user", "content": question(rng, args.question_words)}]
        turn = Turn(index, number, messages)
        await chat_turn(http, model, turn, args.max_tokens)
        turns.append(turn)
        if turn.error:
            break
        messages = [*messages, {"role": "assistant", "content": turn.answer}]
        if args.think_s and number < args.turns:  # the user reads the answer and types
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think_s)
    return turns


async def run_conversations(base_url: str, args: argparse.Namespace, routing: bool) -> RunResult:
    result = RunResult(routing)
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=args.timeout_s) as http:
        model = (await http.get("/models")).json()["data"][0]["id"]
        await all_workers_ready(http, args.workers)

        async def one(index: int) -> list[Turn]:
            async with limit:
                return await conversation(http, model, index, args)

        started = time.perf_counter()
        runs = await asyncio.gather(*(one(i) for i in range(args.conversations)))
        result.duration_s = time.perf_counter() - started
        result.turns = [turn for turns in runs for turn in turns]
        await annotate(http, base_url, result.turns)
    return result


async def all_workers_ready(http: httpx.AsyncClient, num_workers: int) -> None:
    """`/ready` answers once one worker is up; the others may still be timing kernels."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        workers = (await http.get("/workers")).json().get("data", [])
        if sum(1 for w in workers if w["status"] == "ready") >= num_workers:
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"{num_workers} workers not ready after 600 s")


async def annotate(http: httpx.AsyncClient, base_url: str, turns: list[Turn]) -> None:
    """After the run (outside the timing): the possible hits, and where each job ran."""
    root = base_url.removesuffix("/v1")
    by_key = {(t.conversation, t.turn): t for t in turns}
    for turn in turns:
        job = (await http.get(f"/jobs/{turn.job_id}")).json() if turn.job_id else {}
        turn.worker_id, turn.routed_to = job.get("worker_id"), job.get("routed_to")
        turn.phases_s = phases(job.get("timings") or {})
        previous = by_key.get((turn.conversation, turn.turn - 1))
        if previous is None or previous.error or turn.error:
            continue
        ids = await _tokenize(http, root, turn.messages, generation_prompt=True)
        history = [*previous.messages, {"role": "assistant", "content": previous.answer}]
        before = await _tokenize(http, root, history, generation_prompt=False)
        usable = min(_common_prefix(ids, before), len(ids) - 1)  # the last is always computed
        turn.possible_tokens = usable // BLOCK_SIZE * BLOCK_SIZE


# Where a turn's time to first token goes, from the job's timings (shared/contracts.Timings).
PHASES = {
    "queue": ("queued_at", "picked_at"),
    "setup": ("picked_at", "started_at"),
    "engine_queue": ("started_at", "scheduled_at"),
    "prefill": ("scheduled_at", "first_token_at"),
}


def phases(timings: dict[str, float | None]) -> dict[str, float]:
    spans = {}
    for name, (start, end) in PHASES.items():
        if timings.get(start) and timings.get(end):
            spans[name] = max(0.0, timings[end] - timings[start])  # type: ignore[operator]
    return spans


def _common_prefix(a: list[int], b: list[int]) -> int:
    pairs = zip(a, b, strict=False)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(a), len(b)))


async def _tokenize(
    http: httpx.AsyncClient, root: str, messages: list[dict[str, str]], generation_prompt: bool
) -> list[int]:
    body = {"messages": messages, "add_generation_prompt": generation_prompt}
    response = await http.post(f"{root}/tokenize", json=body)
    response.raise_for_status()
    return response.json()["tokens"]


def summary(result: RunResult) -> dict[str, Any]:
    ok = [t for t in result.turns if not t.error]
    later = [t for t in ok if t.turn >= 2]
    first = [t for t in ok if t.turn == 1]
    possible = sum(t.possible_tokens for t in later)
    hit = sum(min(t.cached_tokens, t.possible_tokens) for t in later)
    return {
        "routing": "on" if result.routing else "off",
        "requests": len(result.turns),
        "errors": len(result.turns) - len(ok),
        "hit_rate_of_possible": hit / possible if possible else 0.0,
        "cached_tokens_turns_2plus": sum(t.cached_tokens for t in later),
        "possible_tokens_turns_2plus": possible,
        "prompt_tokens_turns_2plus": sum(t.prompt_tokens for t in later),
        "ttft_turn1_median_s": _median([t.ttft_s for t in first]),
        "ttft_turns_2plus_median_s": _median([t.ttft_s for t in later]),
        "ttft_turns_2plus_p90_s": _quantile([t.ttft_s for t in later], 0.9),
        "phases_turns_2plus_median_s": {
            name: _median([t.phases_s[name] for t in later if name in t.phases_s])
            for name in PHASES
        },
        "routed": sum(1 for t in ok if t.routed_to),
        "routed_taken_by_holder": sum(1 for t in ok if t.routed_to and t.routed_to == t.worker_id),
        "jobs_per_worker": _count(t.worker_id for t in ok),
        "duration_s": round(result.duration_s, 1),
    }


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 4)


def _count(items: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[str(item)] = counts.get(str(item), 0) + 1
    return counts


def format_rows(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| routing | hit rate (of possible) | cached / possible tokens, turns 2+ | "
        "median TTFT turn 1 | median TTFT turns 2+ | p90 TTFT turns 2+ | routed | wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['routing']} | {r['hit_rate_of_possible']:.1%} | "
            f"{r['cached_tokens_turns_2plus']} / {r['possible_tokens_turns_2plus']} | "
            f"{r['ttft_turn1_median_s'] * 1000:.0f} ms | "
            f"{r['ttft_turns_2plus_median_s'] * 1000:.0f} ms | "
            f"{r['ttft_turns_2plus_p90_s'] * 1000:.0f} ms | {r['routed']}/{r['requests']} | "
            f"{r['duration_s']:.0f} s |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.multiturn", description=__doc__)
    parser.add_argument("--routing", choices=("both", "on", "off"), default="both")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    parser.add_argument("--question-words", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="mean pause between an answer and the next turn (0.5-1.5x; 0: none)",
    )
    parser.add_argument("--model", help="LLM_MODEL_NAME for the workers (default: the default)")
    parser.add_argument("--base-url", help="an already running service (its routing as it is)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    parser.add_argument("--json", help="write the summaries here")
    return parser.parse_args(argv)


def run_one(args: argparse.Namespace, routing: bool) -> dict[str, Any]:
    if args.base_url:
        return summary(asyncio.run(run_conversations(args.base_url, args, routing)))
    env = {"LLM_PREFIX_ROUTING": "true" if routing else "false"}
    with running_service(args.workers, args.model, extra_env=env) as base_url:
        return summary(asyncio.run(run_conversations(base_url, args, routing)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.routing]
    rows = []
    for routing in modes:
        rows.append(run_one(args, routing))
        print(json.dumps(rows[-1]), flush=True)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

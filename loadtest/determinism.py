"""Same request, same answer, through the service: distinct greedy chat prompts, each sent
alone (cold cache), again inside a mix of other traffic, and again once its prompt is cached.

    python -m loadtest.determinism                          # 200 prompts, bf16
    python -m loadtest.determinism --env LLM_QUANTIZATION=int4
    python -m loadtest.determinism --prompts 20 --max-tokens 16    # a quick look

Starts `ladle up` (one worker, its own Redis) on the default model, then:
  1. alone: each prompt in turn, nothing else running (its prompt is not cached yet);
  2. mixed: every prompt again, `--concurrency` requests at a time, half of them other
     traffic (other prompts, sampled, of other lengths), so each probe shares its steps
     with rows of every kind and its prompt mostly comes from the prefix cache;
  3. cached: each prompt alone again with every full block of its prompt in the prefix cache
     (`cached_tokens`; a prompt evicted since is sent once more first).
It prints, and writes to `--md`, how many answers are identical to pass 1 (text and
finish reason), the first differences, `lscpu` model and the worker's mode. Bounded: every
pass ends after `--max-seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from loadtest.bench_serve import running_service

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16  # the default LLM_BLOCK_SIZE
TOPICS = (
    "the water cycle",
    "photosynthesis",
    "black holes",
    "the French Revolution",
    "volcanoes",
    "vaccines",
    "the stock market",
    "machine learning",
    "the Roman Empire",
    "earthquakes",
    "climate change",
    "the human heart",
    "electric cars",
    "the moon landing",
    "coral reefs",
    "inflation",
    "the printing press",
    "DNA",
    "solar panels",
    "honey bees",
    "the Internet",
    "plate tectonics",
    "the immune system",
    "jazz music",
    "the Great Wall of China",
)
FORMS = (
    "Explain {} to a ten-year-old.",
    "Give three facts about {}.",
    "Write one sentence about {}.",
    "What is the most surprising thing about {}?",
    "Summarize {} in two sentences.",
    "Why does {} matter?",
    "Write a short poem about {}.",
    "List two common myths about {}.",
)


@dataclass
class Answer:
    text: str
    finish_reason: str
    cached_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def fully_cached(self) -> bool:
        """Every full block but the one holding the last prompt token came from the cache."""
        return self.cached_tokens >= (self.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE > 0


@dataclass
class Report:
    passes: dict[str, dict[int, Answer]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)


def prompts(count: int) -> list[str]:
    texts = [form.format(topic) for form in FORMS for topic in TOPICS]
    if count > len(texts):
        raise SystemExit(f"at most {len(texts)} distinct prompts")
    return random.Random(0).sample(texts, count)


async def ask(client: httpx.AsyncClient, model: str, text: str, max_tokens: int, **extra) -> Answer:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    response = await client.post("/chat/completions", json=body)
    response.raise_for_status()
    data = response.json()
    choice = data["choices"][0]
    details = data["usage"].get("prompt_tokens_details") or {}
    return Answer(
        choice["message"]["content"], choice["finish_reason"], details.get("cached_tokens", 0)
    )


async def alone(client, model, texts, max_tokens, deadline, cached=False) -> dict[int, Answer]:
    out = {}
    for i, text in enumerate(texts):
        if time.monotonic() > deadline:
            break
        out[i] = await ask(client, model, text, max_tokens)
        if cached and not out[i].fully_cached:  # evicted since: this copy cached it again
            out[i] = await ask(client, model, text, max_tokens)
    return out


async def mixed(client, model, texts, max_tokens, concurrency, deadline) -> dict[int, Answer]:
    """Probes from a queue on half the slots, other traffic on the rest, until probes run out."""
    out: dict[int, Answer] = {}
    queue = list(enumerate(texts))
    rng = random.Random(1)

    async def probes() -> None:
        while queue and time.monotonic() < deadline:
            i, text = queue.pop(0)
            out[i] = await ask(client, model, text, max_tokens)

    async def traffic() -> None:
        while queue and time.monotonic() < deadline:
            text = rng.choice(TOPICS) + " " + " ".join(rng.sample(TOPICS, 3))
            extra = {"temperature": 0.8, "seed": rng.randrange(1 << 30)}
            await ask(
                client, model, f"Tell me about {text}.", rng.randint(4, 3 * max_tokens), **extra
            )

    half = max(1, concurrency // 2)
    await asyncio.gather(
        *(probes() for _ in range(half)), *(traffic() for _ in range(concurrency - half))
    )
    return out


async def run(base_url: str, args: argparse.Namespace) -> tuple[Report, dict]:
    texts = prompts(args.prompts)
    report = Report()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        model = (await client.get("/models")).json()["data"][0]["id"]
        workers = (await client.get("/workers")).json()
        steps = {
            "alone": lambda d: alone(client, model, texts, args.max_tokens, d),
            "mixed": lambda d: mixed(client, model, texts, args.max_tokens, args.concurrency, d),
            "cached": lambda d: alone(client, model, texts, args.max_tokens, d, cached=True),
        }
        for name, step in steps.items():
            started = time.monotonic()
            report.passes[name] = await step(started + args.max_seconds)
            report.seconds[name] = time.monotonic() - started
    return report, workers


def summarize(report: Report, texts: list[str]) -> tuple[str, bool]:
    first = report.passes["alone"]
    lines, all_same = [], True
    for name, answers in report.passes.items():
        common = [i for i in answers if i in first]
        same = sum(
            answers[i].text == first[i].text and answers[i].finish_reason == first[i].finish_reason
            for i in common
        )
        cached = sum(answers[i].fully_cached for i in common)
        all_same &= same == len(common) == len(texts)
        lines.append(
            f"| {name} | {len(common)} | {same} | {cached} | {report.seconds[name]:.0f} s |"
        )
    diffs = [
        f"- prompt {i} ({texts[i]!r}), {name}: {first[i].text[:80]!r} vs {a.text[:80]!r}"
        for name, answers in report.passes.items()
        for i, a in answers.items()
        if i in first and a.text != first[i].text
    ][:10]
    table = (
        "| pass | answers | identical to alone | prompt cached | time |\n|---|---|---|---|---|\n"
    )
    return table + "\n".join(lines) + (
        "\n\nFirst differences:\n" + "\n".join(diffs) if diffs else ""
    ), all_same


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except OSError:
        return platform.processor()
    return next(
        (
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        ),
        "",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-seconds", type=float, default=900.0, help="per pass")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="for the service"
    )
    p.add_argument("--md", default=str(ROOT / ".cache" / "determinism.md"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(pair.split("=", 1) for pair in args.env)
    with running_service(extra_env=env) as base_url:
        report, workers = asyncio.run(run(base_url, args))
    table, all_same = summarize(report, prompts(args.prompts))
    worker = workers["data"][0] if workers.get("data") else {}
    header = (
        f"`python -m loadtest.determinism {' '.join(argv or [])}`: {args.prompts} prompts, "
        f"{args.max_tokens} greedy tokens, mix at concurrency {args.concurrency}; "
        f"CPU {lscpu_model()}; env {json.dumps(env)}; worker dtype {worker.get('dtype')}, "
        f"deterministic {worker.get('deterministic')} {worker.get('deterministic_reason', '')}\n\n"
    )
    complete = all(len(answers) == args.prompts for answers in report.passes.values())
    verdict = "ALL IDENTICAL" if all_same else "DIFFERENCES FOUND" if complete else "INCOMPLETE"
    text = header + table + f"\n\n{verdict}\n"
    print(text)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(text)
    return 0 if all_same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Serving-benchmark workload and metrics, shared by bench_serve.py and vs_vllm.py.

A workload is N prompts of random token ids per concurrency level (a different set per level,
so prefix caching never helps a later level), driven closed-loop: `concurrency` clients each
send their next request as soon as the previous one ends, until the prompts run out or the
level's time limit passes (requests in flight then still finish). No torch, no HTTP here.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Workload:
    """What every system under test is asked, identically."""

    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 128
    seed: int = 0
    # Token ids are drawn from [low_token_id, vocab_size): above special and byte tokens.
    low_token_id: int = 1000
    vocab_size: int = 49152

    def prompts(self, level_index: int) -> list[list[int]]:
        """The prompts of one concurrency level (deterministic per seed and level)."""
        rng = random.Random(self.seed * 1_000_003 + level_index)
        low = min(self.low_token_id, max(self.vocab_size // 4, 1))
        return [
            [rng.randrange(low, self.vocab_size) for _ in range(self.input_len)]
            for _ in range(self.num_prompts)
        ]


@dataclass
class RequestRecord:
    """One request as the client saw it: times are time.perf_counter() seconds."""

    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


# One request: given its prompt, fill in and return a RequestRecord (never raise).
SendFn = Callable[[list[int]], Awaitable[RequestRecord]]


@dataclass
class Dist:
    """mean / median / p99 in milliseconds."""

    mean: float = math.nan
    median: float = math.nan
    p99: float = math.nan

    @classmethod
    def of(cls, seconds: list[float]) -> Dist:
        if not seconds:
            return cls()
        ms = sorted(s * 1000.0 for s in seconds)
        return cls(statistics.fmean(ms), statistics.median(ms), percentile(ms, 99.0))


@dataclass
class LevelResult:
    """The figures of one concurrency level."""

    concurrency: int
    num_ok: int
    num_failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    tpot_ms: Dist
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of already sorted values."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(concurrency: int, records: list[RequestRecord], duration_s: float) -> LevelResult:
    """Per-level figures; throughput counts only the output of requests that succeeded."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    duration = max(duration_s, 1e-9)
    return LevelResult(
        concurrency=concurrency,
        num_ok=len(ok),
        num_failed=len(failed),
        duration_s=duration_s,
        output_tokens=tokens,
        output_tokens_per_s=tokens / duration,
        requests_per_s=len(ok) / duration,
        ttft_ms=Dist.of([r.ttft for r in ok]),
        itl_ms=Dist.of([gap for r in ok for gap in r.itls]),
        e2e_ms=Dist.of([r.e2e for r in ok]),
        tpot_ms=Dist.of(tpots),
        errors=sorted({r.error or "no tokens" for r in failed})[:5],
    )


async def run_level(
    send: SendFn, prompts: list[list[int]], concurrency: int, max_seconds: float
) -> tuple[list[RequestRecord], float]:
    """Closed loop: `concurrency` clients share the prompts until done or out of time."""
    pending = list(reversed(prompts))
    records: list[RequestRecord] = []
    started = time.perf_counter()
    deadline = started + max_seconds

    async def client() -> None:
        while pending and time.perf_counter() < deadline:
            records.append(await send(pending.pop()))

    await asyncio.gather(*(client() for _ in range(concurrency)))
    end = max((r.end for r in records), default=time.perf_counter())
    return records, end - started


async def run_levels(
    send: SendFn,
    workload: Workload,
    levels: list[int],
    max_seconds: float,
    log: Callable[[str], None] = print,
) -> list[LevelResult]:
    """Every concurrency level in turn, each with its own prompts."""
    results = []
    for index, concurrency in enumerate(levels):
        records, duration = await run_level(send, workload.prompts(index), concurrency, max_seconds)
        result = summarize(concurrency, records, duration)
        log(
            f"  concurrency {concurrency}: {result.num_ok} ok, {result.num_failed} failed, "
            f"{result.output_tokens_per_s:.1f} tok/s, median ITL {result.itl_ms.median:.1f} ms"
        )
        results.append(result)
    return results


def format_table(title: str, results: list[LevelResult]) -> str:
    """A markdown table of the per-level figures."""
    lines = [
        f"**{title}**",
        "",
        "| conc | ok | failed | out tok/s | req/s | TTFT mean / med / p99 ms "
        "| ITL mean / med / p99 ms | TPOT med ms | e2e mean / med / p99 ms |",
        "|---:|---:|---:|---:|---:|---|---|---:|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.num_ok} | {r.num_failed} | {r.output_tokens_per_s:.1f} "
            f"| {r.requests_per_s:.2f} | {_d(r.ttft_ms)} | {_d(r.itl_ms)} "
            f"| {r.tpot_ms.median:.1f} | {_d(r.e2e_ms, 0)} |"
        )
    return "\n".join(lines)


def format_ratios(service: list[LevelResult], engine: list[LevelResult]) -> str:
    """Service vs engine: throughput ratio and added median ITL / TTFT per level."""
    lines = [
        "| conc | service tok/s | engine tok/s | ratio | added median ITL ms "
        "| added median TTFT ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s, e in zip(service, engine, strict=False):
        ratio = s.output_tokens_per_s / e.output_tokens_per_s if e.output_tokens_per_s else 0
        lines.append(
            f"| {s.concurrency} | {s.output_tokens_per_s:.1f} | {e.output_tokens_per_s:.1f} "
            f"| {ratio:.2f} | {s.itl_ms.median - e.itl_ms.median:+.2f} "
            f"| {s.ttft_ms.median - e.ttft_ms.median:+.1f} |"
        )
    return "\n".join(lines)


def _d(dist: Dist, digits: int = 1) -> str:
    return f"{dist.mean:.{digits}f} / {dist.median:.{digits}f} / {dist.p99:.{digits}f}"

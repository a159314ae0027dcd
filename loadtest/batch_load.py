"""The Batch API under load, against `ladle up` on the real default model (or `--model`).

    python -m loadtest.batch_load chaos   # 1,000 lines, 2 workers: a worker and the API
                                          # are SIGKILLed mid-batch (`ladle up` restarts them);
                                          # exactly 1,000 lines across output and error files
    python -m loadtest.batch_load lanes   # median TTFT of interactive requests at concurrency
                                          # 2, idle vs. while a 500-line batch runs

Both print one JSON report (load average, CPU model, command, figures); `lanes` passes when
the busy/idle TTFT ratio is within `--max-ratio` (1.5). Redis: LLM_REDIS_URL (default
127.0.0.1:6379/0) under a fresh key prefix, removed afterwards. Every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import openai
import redis

from loadtest.bench_serve import spare_port
from loadtest.up import UpProcess, kill_child
from shared.keys import Keys

FINAL = ("completed", "failed", "expired", "cancelled")


def machine() -> dict[str, str]:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    return {
        "cpu": fields.get("Model name", platform.processor()).strip(),
        "flags_bf16_amx": " ".join(
            f for f in fields.get("Flags", "").split() if "bf16" in f or "amx" in f
        ),
        "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "command": " ".join(
            [Path(sys.executable).name, "-m", "loadtest.batch_load", *sys.argv[1:]]
        ),
    }


def batch_lines(count: int, max_tokens: int, invalid_every: int = 0) -> tuple[bytes, set[str]]:
    """`count` lines alternating chat and text completions; every `invalid_every`-th one
    has an out-of-range temperature. Returns the JSONL and the invalid custom_ids."""
    lines, invalid = [], set()
    for i in range(count):
        words = f"Write a short note number {i} about soup, bread and tea."
        body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            url, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": words}]
        else:
            url, body["prompt"] = "/v1/completions", words
        if invalid_every and i % invalid_every == invalid_every - 1:
            body["temperature"] = 7
            invalid.add(f"line-{i}")
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body})
    return "".join(json.dumps(line) + "\n" for line in lines).encode(), invalid


def start(args: argparse.Namespace, num_workers: int, **env: str) -> UpProcess:
    extra = ["--model", args.model] if args.model else []
    return start_up(args.redis_url, "batchload", num_workers, extra, 600, **env)


def start_up(
    redis_url: str, name: str, ready_workers: int, extra: list[str], timeout_s: float, **env: str
) -> UpProcess:
    """`ladle up` under a fresh key prefix `name-<hex>`, quiet, back once `ready_workers`
    workers are up (`extra` may name per-model `--worker`s instead of `--workers`)."""
    prefix = f"{name}-{uuid.uuid4().hex[:8]}"
    base_env = dict(
        os.environ,
        LLM_REDIS_URL=redis_url,
        LLM_KEY_PREFIX=prefix,
        LLM_WORKER_METRICS_PORT="0",
        LLM_SUPERVISOR_METRICS_PORT="0",
        LLM_LOG_LEVEL="WARNING",
        **env,
    )
    log = Path(tempfile.gettempdir()) / f"{prefix}.log"
    workers = 1 if "--worker" in extra else ready_workers
    up = UpProcess(base_env, spare_port(), workers, log, extra_args=extra)
    up.start()
    with httpx.Client(timeout=10) as http:
        up.wait_ready(http, ready_workers, timeout=timeout_s)
    return up


def cleanup(up: UpProcess) -> None:
    client = redis.Redis.from_url(up.redis_url)
    prefix = up.env["LLM_KEY_PREFIX"]
    for key in client.scan_iter(f"{prefix}:job:*", count=1000):
        job_id = Keys.job_id_of(key)
        client.delete(*(f"arq:{kind}:{job_id}" for kind in ("job", "result", "retry")))
    for pattern in (f"{prefix}:*", f"arq:*{prefix}*"):
        keys = list(client.scan_iter(pattern, count=1000))
        for start_at in range(0, len(keys), 1000):
            client.delete(*keys[start_at : start_at + 1000])


def client_for(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.base_url + "/v1", api_key="none", max_retries=5)


def submit(client: openai.OpenAI, content: bytes) -> str:
    uploaded = client.files.create(file=("load.jsonl", content), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    return batch.id


def wait_batch(client: openai.OpenAI, batch_id: str, until: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except openai.APIConnectionError:  # the API is being restarted
            time.sleep(0.5)
            continue
        if until(batch):
            return batch
        time.sleep(0.5)
    raise TimeoutError(f"batch {batch_id}: condition not met in {timeout_s} s")


def done(batch: Any) -> int:
    return batch.request_counts.completed + batch.request_counts.failed


# ---- chaos -----------------------------------------------------------------------------------


def run_chaos(args: argparse.Namespace) -> dict[str, Any]:
    up = start(args, 2, LLM_BATCH_POLL_S="0.5")
    try:
        client = client_for(up)
        content, invalid = batch_lines(args.lines, args.max_tokens, invalid_every=25)
        started = time.monotonic()
        batch_id = submit(client, content)
        events = []
        for fraction, child in ((0.2, "worker-0"), (0.5, "api")):
            wait_batch(client, batch_id, lambda b, f=fraction: done(b) >= f * args.lines, 3600)
            events.append({"at_lines": done(client.batches.retrieve(batch_id)), "killed": child})
            kill_child(up, child, signal.SIGKILL)
        batch = wait_batch(client, batch_id, lambda b: b.status in FINAL, 3600)
        seconds = time.monotonic() - started
        outputs = _lines(client, batch.output_file_id)
        errors = _lines(client, batch.error_file_id)
    finally:
        up.stop()
        cleanup(up)
    ids = [line["custom_id"] for line in outputs + errors]
    return {
        "status": batch.status,
        "lines": args.lines,
        "output_lines": len(outputs),
        "error_lines": len(errors),
        "unique_custom_ids": len(set(ids)),
        "errors_are_the_invalid_lines": {e["custom_id"] for e in errors} == invalid,
        "kills": events,
        "seconds": round(seconds, 1),
        "lines_per_s": round(args.lines / seconds, 2),
        "ok": batch.status == "completed"
        and len(ids) == len(set(ids)) == args.lines
        and {e["custom_id"] for e in errors} == invalid,
    }


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


# ---- lanes -----------------------------------------------------------------------------------


async def ttfts(base_url: str, model: str, count: int, concurrency: int) -> list[float]:
    """Seconds to the first streamed token of `count` chat requests, `concurrency` at a time."""
    results: list[float] = []
    queue = list(range(count))

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": f"Question {i}: name a soup and a bread."}],
            "max_tokens": 16,
            "temperature": 0,
            "stream": True,
        }
        started = time.perf_counter()
        first: float | None = None
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for line in response.aiter_lines():  # read to the end: a complete request
                if first is None and line.startswith("data: ") and _has_content(line):
                    first = time.perf_counter() - started
        if first is not None:
            results.append(first)

    async def client_loop() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
            while queue:
                await one(http, queue.pop(0))

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results


def _has_content(line: str) -> bool:
    """An SSE line carrying generated text (not the role chunk, usage or [DONE])."""
    if line == "data: [DONE]":
        return False
    choices = json.loads(line[len("data: ") :]).get("choices") or [{}]
    return bool(choices[0].get("delta", {}).get("content"))


def run_lanes(args: argparse.Namespace) -> dict[str, Any]:
    up = start(args, 1, LLM_BATCH_POLL_S="0.5")
    try:
        client = client_for(up)
        model = client.models.list().data[0].id
        asyncio.run(ttfts(up.base_url, model, 4, args.concurrency))  # warm-up
        idle = asyncio.run(ttfts(up.base_url, model, args.requests, args.concurrency))
        content, _ = batch_lines(args.batch_lines, args.lane_line_tokens)
        batch_id = submit(client, content)
        before = wait_batch(client, batch_id, lambda b: done(b) >= 2, 600)
        busy = asyncio.run(ttfts(up.base_url, model, args.requests, args.concurrency))
        after = client.batches.retrieve(batch_id)
        workers = httpx.get(up.base_url + "/v1/workers", timeout=10).json()["data"]
        if after.status not in FINAL:
            client.batches.cancel(batch_id)
            wait_batch(client, batch_id, lambda b: b.status in FINAL, 600)
    finally:
        up.stop()
        cleanup(up)
    ratio = statistics.median(busy) / statistics.median(idle)
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "idle_ttft_median_ms": round(statistics.median(idle) * 1000, 1),
        "busy_ttft_median_ms": round(statistics.median(busy) * 1000, 1),
        "ratio": round(ratio, 2),
        "batch_lines_done_during_busy_phase": done(after) - done(before),
        "batch_still_running_after_busy_phase": after.status == "in_progress",
        "batch_running_at_end": sum(w["running"] for w in workers),
        "ok": ratio <= args.max_ratio and after.status == "in_progress",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("chaos", "lanes"))
    parser.add_argument("--model", help="LLM_MODEL_NAME for the workers (default model)")
    parser.add_argument(
        "--redis-url", default=os.environ.get("LLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    parser.add_argument("--lines", type=int, default=1000, help="chaos: batch lines (1000)")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per batch line (8)")
    parser.add_argument("--batch-lines", type=int, default=500, help="lanes: batch lines (500)")
    parser.add_argument("--requests", type=int, default=24, help="lanes: requests per phase")
    parser.add_argument(
        "--lane-line-tokens", type=int, default=96, help="lanes: tokens per batch line (96)"
    )
    parser.add_argument("--concurrency", type=int, default=2, help="lanes: concurrency (2)")
    parser.add_argument("--max-ratio", type=float, default=1.5, help="lanes: pass mark (1.5)")
    args = parser.parse_args(argv)
    report = {**machine(), **(run_chaos(args) if args.mode == "chaos" else run_lanes(args))}
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""A large `/v1/embeddings` batch through the Batch API while chat traffic runs.

    python -m loadtest.batch_embeddings [--lines 10000] [--requests 24] [--concurrency 2]
        [--chat-model SmolLM2-135M-Instruct] [--embed-model all-MiniLM-L6-v2]

Starts `ladle up --worker CHAT --worker EMBED` (one worker each), measures the median TTFT
of streamed chat requests idle, submits a batch of `--lines` embedding lines (sentences of
loadtest/data/english.txt), measures the chat TTFT again while the batch runs, and waits
for the batch to finish: every line must have its output line. Prints one JSON report
(CPU model, load average, command, TTFT before/during, lines/s). Redis: LLM_REDIS_URL
(default 127.0.0.1:6379/0) under a fresh key prefix, removed afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import openai

from loadtest.batch_load import cleanup, done, machine, start_up, ttfts, wait_batch
from loadtest.bench_embeddings import sentences
from loadtest.up import UpProcess


def embedding_lines(count: int, model: str) -> bytes:
    texts = sentences(count)
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": model, "input": text},
        }
        for i, text in enumerate(texts)
    ]
    return "\n".join(json.dumps(line) for line in lines).encode()


def start(args: argparse.Namespace) -> UpProcess:
    extra = ["--worker", args.chat_model, "--worker", args.embed_model]
    batch_env = {"LLM_BATCH_POLL_S": "0.5", "LLM_BATCH_MAX_LINES": str(max(args.lines, 50_000))}
    return start_up(args.redis_url, "batchembed", 2, extra, 900, **batch_env)


def run(args: argparse.Namespace) -> dict[str, Any]:
    up = start(args)
    try:
        client = openai.OpenAI(base_url=up.base_url + "/v1", api_key="none", max_retries=5)
        chat = Path(args.chat_model).name
        asyncio.run(ttfts(up.base_url, chat, 4, args.concurrency))  # warm-up
        idle = asyncio.run(ttfts(up.base_url, chat, args.requests, args.concurrency))
        uploaded = client.files.create(
            file=("embed.jsonl", embedding_lines(args.lines, Path(args.embed_model).name)),
            purpose="batch",
        )
        started = time.monotonic()
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
        )
        wait_batch(client, batch.id, lambda b: done(b) >= 100, 900)
        busy = asyncio.run(ttfts(up.base_url, chat, args.requests, args.concurrency))
        during = client.batches.retrieve(batch.id)
        final = wait_batch(client, batch.id, lambda b: b.status == "completed", 3600)
        elapsed = time.monotonic() - started
        output = client.files.content(final.output_file_id).text.splitlines()
    finally:
        up.stop()
        cleanup(up)
    command = " ".join(
        [Path(sys.executable).name, "-m", "loadtest.batch_embeddings", *sys.argv[1:]]
    )
    return {
        **machine(),
        "command": command,
        "lines": args.lines,
        "output_lines": len(output),
        "completed": final.request_counts.completed,
        "failed": final.request_counts.failed,
        "batch_seconds": round(elapsed, 1),
        "lines_per_s": round(args.lines / elapsed, 1),
        "chat_ttft_idle_median_ms": round(statistics.median(idle) * 1000, 1),
        "chat_ttft_during_batch_median_ms": round(statistics.median(busy) * 1000, 1),
        "batch_in_progress_while_measured": during.status == "in_progress",
        "ok": len(output) == args.lines == final.request_counts.completed,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=24, help="chat requests per phase")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--chat-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--embed-model", default="all-MiniLM-L6-v2")
    parser.add_argument(
        "--redis-url", default=os.environ.get("LLM_REDIS_URL", "redis://127.0.0.1:6379/0")
    )
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

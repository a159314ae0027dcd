"""The chaos run's batches and its final sweep: every batch line answered exactly once, the
workers idle (no KV block, no running sequence), every job record in Redis final with at most
one terminal event in its stream."""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import httpx

from loadtest.chaos_load import PROMPTS, Ledger, request_body
from shared.keys import Keys
from shared.redis_url import sync_client

if TYPE_CHECKING:
    from loadtest.chaos import ChaosConfig

FINAL = {"completed", "failed", "cancelled"}
BATCH_DONE = {"completed", "failed", "expired", "cancelled"}


async def run_batches(
    http: httpx.AsyncClient, model: str, config: ChaosConfig, ledger: Ledger, stop_at: float
) -> None:
    """Submit a batch every `batch_every` s while the load runs; then wait for all of them."""
    batches: list[tuple[str, set[str]]] = []
    next_at = time.monotonic() + 10.0
    while time.monotonic() < stop_at:
        if time.monotonic() >= next_at and config.batch_lines:
            submitted = await _submit(http, model, config, len(batches))
            if submitted is not None:
                batches.append(submitted)
                ledger.batch_lines += len(submitted[1])
            next_at = time.monotonic() + config.batch_every
        await asyncio.sleep(0.5)
    for batch_id, custom_ids in batches:
        await _collect(http, batch_id, custom_ids, ledger)


async def _submit(
    http: httpx.AsyncClient, model: str, config: ChaosConfig, number: int
) -> tuple[str, set[str]] | None:
    custom_ids = {f"b{number}-{i}" for i in range(config.batch_lines)}
    lines = [
        json.dumps(
            {
                "custom_id": cid,
                "method": "POST",
                "url": "/v1/completions",
                "body": request_body("sync", PROMPTS[i % len(PROMPTS)], model, config.max_tokens)[
                    1
                ],
            }
        )
        for i, cid in enumerate(sorted(custom_ids))
    ]
    try:
        files = {"file": ("chaos.jsonl", "\n".join(lines).encode(), "application/jsonl")}
        uploaded = await http.post("/v1/files", files=files, data={"purpose": "batch"})
        batch = await http.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/completions",
                "completion_window": "24h",
            },
        )
        return batch.json()["id"], custom_ids
    except (httpx.HTTPError, KeyError, ValueError):
        return None  # refused while a fault was on: its lines were never accepted


async def _collect(
    http: httpx.AsyncClient, batch_id: str, custom_ids: set[str], ledger: Ledger
) -> None:
    deadline = time.monotonic() + 300
    batch: dict = {}
    while time.monotonic() < deadline:
        try:
            batch = (await http.get(f"/v1/batches/{batch_id}")).json()
        except (httpx.HTTPError, ValueError):
            batch = {}
        if batch.get("status") in BATCH_DONE:
            break
        await asyncio.sleep(1.0)
    seen: dict[str, int] = {}
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            content = (await http.get(f"/v1/files/{batch[key]}/content")).text
            for line in filter(None, content.splitlines()):
                cid = json.loads(line)["custom_id"]
                seen[cid] = seen.get(cid, 0) + 1
    ledger.batch_lines_answered += len(custom_ids & set(seen))
    for cid, count in seen.items():
        if count > 1:
            ledger.duplicated += count - 1
            ledger.details.append(f"batch {batch_id} line {cid} answered {count} times")


async def wait_idle(num_workers: int, http: httpx.AsyncClient, ledger: Ledger) -> None:
    """Until every worker is back and idle (120 s at most); record what each one holds."""
    deadline = time.monotonic() + 120
    workers: list[dict] = []
    while time.monotonic() < deadline:
        try:
            workers = (await http.get("/v1/workers")).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            workers = []
        idle = all(w["kv_blocks_used"] == 0 and w["running"] == 0 for w in workers)
        if len(workers) >= num_workers and idle:
            break
        await asyncio.sleep(0.5)
    for worker in workers:
        ledger.kv_blocks_left[worker["id"]] = worker["kv_blocks_used"]
        ledger.running_left[worker["id"]] = worker["running"]
    if len(workers) < num_workers:
        ledger.kv_blocks_left["missing workers"] = num_workers - len(workers)


def check_redis(redis_url: str, keys: Keys, ledger: Ledger) -> None:
    """Every job record final; no stream with two terminal events (a duplicated output)."""
    client = sync_client(redis_url, socket_timeout=5)
    for key in client.scan_iter(f"{keys.prefix}:job:*", count=500):
        raw = client.get(key)
        if raw is None:
            continue
        record = json.loads(raw)
        if record["status"] not in FINAL:
            ledger.lost += 1
        events = [
            json.loads(fields[b"data"]) for _, fields in client.xrange(keys.stream(record["id"]))
        ]
        extra = sum(event.get("type") in ("done", "error") for event in events) - 1
        if extra > 0:
            ledger.duplicated += extra
            ledger.details.append(
                f"job {record['id']} ({record['status']}, attempts {record.get('attempts')}, "
                f"worker {record.get('worker_id')}): {extra + 1} terminal events: "
                + stream_summary(events)
            )
    client.close()


def stream_summary(events: list[dict]) -> str:
    """A stream's events in a line: runs of deltas counted, the rest with whose they are."""
    parts: list[str] = []
    for event in events:
        kind = event.get("type")
        if kind == "delta":
            if parts and parts[-1].startswith("delta x"):
                parts[-1] = f"delta x{int(parts[-1][7:]) + 1}"
            else:
                parts.append("delta x1")
        elif kind == "started":
            parts.append(f"started(attempt {event.get('attempt')}, {event.get('worker_id')})")
        elif kind == "restart":
            parts.append(f"restart(attempt {event.get('attempt')})")
        elif kind == "error":
            parts.append(f"error({event.get('status')} {event.get('code')})")
        else:
            parts.append(str(kind))
    return ", ".join(parts)

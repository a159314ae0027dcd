"""Bounded soak: many streaming clients for a fixed time against the API and one worker.

    python -m loadtest.soak                                  # starts API + worker itself
    python -m loadtest.soak --clients 300 --seconds 120 --max-tokens 32 --json soak.json
    python -m loadtest.soak --base-url http://127.0.0.1:8000 --api-pid 123 --worker-pid 456

Each client loops until time is up: a streaming completion or chat completion (alternating),
read to the end, or, for `--disconnect-fraction` of the requests, dropped after a few chunks.
Checked afterwards (`SoakReport.problems` lists what failed):
  * no 5xx (and no other unexpected status) from any request;
  * every job (its `X-Job-Id`) reaches a final state: `completed`, or `cancelled` when its
    client left; checked with GET /v1/jobs/{id} soon after each stream ends;
  * the workers are idle again: zero KV blocks used, nothing running or waiting;
  * when the soak started the service (short `LLM_JOB_TTL_S`), no per-job Redis key is left
    under the prefix once that TTL has passed;
  * RSS (VmRSS) of the API and worker, measured after a warm-up burst and after the soak,
    within `--rss-tolerance` (10 %).
Everything talks to 127.0.0.1; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import redis

FINAL = ("completed", "failed", "cancelled")
# Per-job keys (shared/keys.py); anything else under the prefix is per worker or global.
PER_JOB_KINDS = ("job", "payload", "stream", "cancelled", "keyjobs")


@dataclass
class SoakConfig:
    clients: int = 300
    seconds: float = 120.0
    disconnect_fraction: float = 0.1
    max_tokens: int = 32
    warmup_s: float = 10.0
    job_ttl_s: int = 10
    rss_tolerance: float = 0.10
    settle_s: float = 2.0
    seed: int = 0


@dataclass
class SoakReport:
    requests: int = 0
    completed_streams: int = 0
    disconnected: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    final_states: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0
    kv_idle_after_s: float | None = None
    leftover_job_keys: int | None = None
    keys_expired_after_s: float | None = None
    rss_kib: dict[str, dict[str, int]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def count(self, table: dict[str, int], key: object) -> None:
        table[str(key)] = table.get(str(key), 0) + 1


def vm_rss_kib(pid: int) -> int:
    """VmRSS of a process, in KiB, from /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


class Soak:
    """The load, the per-job checks and the idle checks against one API."""

    def __init__(
        self, base_url: str, model: str, config: SoakConfig, api_key: str | None = None
    ) -> None:
        self.config = config
        self.model = model
        self.rng = random.Random(config.seed)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=config.clients + 20, max_keepalive_connections=0)
        self.http = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(600.0, connect=30.0),
        )
        self.report = SoakReport()
        self.checks: set[asyncio.Task] = set()

    async def close(self) -> None:
        await self.http.aclose()

    def _body(self, i: int) -> tuple[str, dict]:
        words = " ".join(f"w{self.rng.randrange(200)}" for _ in range(self.rng.randint(4, 24)))
        common = {
            "model": self.model or None,
            "max_tokens": self.config.max_tokens,
            "stream": True,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        if i % 2:
            return "/v1/chat/completions", {
                **common,
                "messages": [{"role": "user", "content": words}],
            }
        return "/v1/completions", {**common, "prompt": words}

    async def run(self, seconds: float) -> None:
        """`clients` loops until `seconds` have passed, then every job's final-state check."""
        deadline = time.monotonic() + seconds
        started = time.monotonic()
        await asyncio.gather(*(self._client(c, deadline) for c in range(self.config.clients)))
        if self.checks:
            await asyncio.wait(self.checks, timeout=60)
        self.report.seconds += time.monotonic() - started

    async def _client(self, client: int, deadline: float) -> None:
        i = client
        while time.monotonic() < deadline:
            await self._one(i, self.rng.random() < self.config.disconnect_fraction)
            i += self.config.clients

    async def _one(self, i: int, disconnect: bool) -> None:
        path, body = self._body(i)
        report = self.report
        report.requests += 1
        try:
            async with self.http.stream("POST", path, json=body) as response:
                report.count(report.statuses, response.status_code)
                if response.status_code != 200:
                    await response.aread()
                    report.problems.append(f"{path}: {response.status_code} {response.text[:200]}")
                    return
                job_id = response.headers.get("x-job-id")
                chunks = await self._read(response, 3 if disconnect else None)
            report.tokens += chunks
            if disconnect:
                report.disconnected += 1
            else:
                report.completed_streams += 1
        except httpx.HTTPError as exc:
            report.count(report.statuses, type(exc).__name__)
            report.problems.append(f"{path}: {exc!r}")
            return
        if not job_id:
            report.problems.append(f"{path}: no X-Job-Id header")
            return
        task = asyncio.create_task(self._check_final(job_id, disconnect))
        self.checks.add(task)
        task.add_done_callback(self.checks.discard)

    async def _read(self, response: httpx.Response, stop_after: int | None) -> int:
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            if '"error"' in line:
                self.report.problems.append(f"error in stream: {line[:200]}")
            chunks += 1
            if stop_after is not None and chunks >= stop_after:
                break  # leaving the `stream` block closes the connection
        return chunks

    async def _check_final(self, job_id: str, disconnected: bool) -> None:
        """Poll the job until final (at most 30 s); a finished stream must be `completed`."""
        status = "unknown"
        for _ in range(300):
            r = await self.http.get(f"/v1/jobs/{job_id}")
            status = (
                r.json().get("status", f"http {r.status_code}")
                if r.status_code == 200
                else f"http {r.status_code}"
            )
            if status in FINAL:
                break
            await asyncio.sleep(0.1)
        self.report.count(self.report.final_states, status)
        if status not in FINAL or (not disconnected and status != "completed"):
            self.report.problems.append(f"job {job_id}: {status} (disconnected={disconnected})")

    async def wait_idle(self, timeout_s: float = 30.0) -> float | None:
        """Seconds until every live worker has no KV block used and nothing to do."""
        started = time.monotonic()
        workers: list = []
        while time.monotonic() - started < timeout_s:
            workers = (await self.http.get("/v1/workers")).json()["data"]
            if workers and all(
                w["kv_blocks_used"] == 0 and w["running"] == 0 and w["waiting"] == 0
                for w in workers
            ):
                return time.monotonic() - started
            await asyncio.sleep(0.2)
        self.report.problems.append(f"workers not idle after {timeout_s} s: {workers}")
        return None


def per_job_keys(redis_url: str, prefix: str) -> list[str]:
    client = redis.Redis.from_url(redis_url)
    keys = []
    for kind in PER_JOB_KINDS:
        keys += [k.decode() for k in client.scan_iter(f"{prefix}:{kind}:*", count=1000)]
    return keys


def wait_keys_expire(report: SoakReport, redis_url: str, prefix: str, ttl_s: int) -> None:
    """Poll (at most TTL + 30 s) until no per-job key is left under the prefix."""
    started = time.monotonic()
    left: list[str] = []
    while time.monotonic() - started < ttl_s + 30:
        left = per_job_keys(redis_url, prefix)
        if not left:
            report.keys_expired_after_s = round(time.monotonic() - started, 1)
            break
        time.sleep(1.0)
    report.leftover_job_keys = len(left)
    if left:
        report.problems.append(f"{len(left)} per-job keys left after TTL {ttl_s} s: {left[:5]}")


def check_rss(
    report: SoakReport, pids: dict[str, int], before: dict[str, int], tolerance: float
) -> None:
    for name, pid in pids.items():
        after = vm_rss_kib(pid)
        report.rss_kib[name] = {"after_warmup": before[name], "after_soak": after}
        if after > before[name] * (1 + tolerance):
            report.problems.append(
                f"{name} RSS grew {before[name]} -> {after} KiB (> {tolerance:.0%})"
            )


async def soak(
    base_url: str, model: str, config: SoakConfig, pids: dict[str, int], api_key: str | None = None
) -> SoakReport:
    """Warm up, measure RSS, soak, check final states, idle workers and RSS."""
    runner = Soak(base_url, model, config, api_key)
    try:
        if config.warmup_s > 0:
            await runner.run(config.warmup_s)
            await runner.wait_idle()
            runner.report = SoakReport()  # the soak's figures exclude the warm-up
        before = {name: vm_rss_kib(pid) for name, pid in pids.items()}
        await runner.run(config.seconds)
        report = runner.report
        report.kv_idle_after_s = await runner.wait_idle()
        await asyncio.sleep(config.settle_s)  # let the processes settle before reading RSS
        check_rss(report, pids, before, config.rss_tolerance)
        bad = {s: n for s, n in report.statuses.items() if s != "200"}
        if bad:
            report.problems.insert(0, f"unexpected statuses: {bad}")
        return report
    finally:
        await runner.close()


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, SoakConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="an API to soak (default: start API + one worker)")
    parser.add_argument(
        "--model",
        default=None,
        help="model dir/.gguf/name to serve, "
        "or the `model` field with --base-url (default: the default model)",
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--api-pid", type=int, help="with --base-url: the API's pid (RSS)")
    parser.add_argument("--worker-pid", type=int, help="with --base-url: the worker's pid (RSS)")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/15")
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--disconnect-fraction", type=float, default=0.1)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--warmup-s", type=float, default=10.0)
    parser.add_argument("--job-ttl-s", type=int, default=10)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument("--kv-cache-mb", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the report here")
    args = parser.parse_args(argv)
    config = SoakConfig(
        args.clients,
        args.seconds,
        args.disconnect_fraction,
        args.max_tokens,
        args.warmup_s,
        args.job_ttl_s,
        args.rss_tolerance,
    )
    return args, config


def _self_started(args: argparse.Namespace, config: SoakConfig) -> SoakReport:
    from shared.config import DEFAULT_MODEL
    from tests.support.harness import start_service

    logs = Path(tempfile.mkdtemp(prefix="ladle-soak-"))
    service = start_service(
        Path(args.model or DEFAULT_MODEL),
        logs,
        redis_url=args.redis_url,
        job_ttl_s=config.job_ttl_s,
        kv_cache_size_mb=args.kv_cache_mb,
        num_threads=args.threads,
        first_event_timeout_s=600,
        request_timeout_s=900,
        max_queue_depth=max(1000, 2 * config.clients),
    )
    try:
        with service.client() as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
        assert service.api is not None and service.workers[0] is not None
        pids = {"api": service.api.pid, "worker": service.workers[0].pid}
        report = asyncio.run(soak(service.base_url, model, config, pids))
        wait_keys_expire(report, args.redis_url, service.prefix, config.job_ttl_s)
        return report
    finally:
        service.stop()
        print(f"service logs: {logs}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args, config = parse_args(argv)
    if args.base_url:
        pids = {
            name: pid for name, pid in (("api", args.api_pid), ("worker", args.worker_pid)) if pid
        }
        report = asyncio.run(soak(args.base_url, args.model or "", config, pids, args.api_key))
    else:
        report = _self_started(args, config)
    text = json.dumps({"config": asdict(config), **asdict(report)}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())

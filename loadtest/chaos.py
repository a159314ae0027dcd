"""Chaos under load: `ladle up` with several workers serves mixed traffic while things break.

    python -m loadtest.chaos                          # 10 minutes, 3 workers, tiny model
    python -m loadtest.chaos --seconds 120 --json chaos.json
    python -m loadtest.chaos --model SmolLM2-135M-Instruct --max-tokens 8

For `--seconds` (default 600) client loops send sync completions, streaming chat, job-API
submissions (polled) and, every `--batch-every` seconds, a batch of `--batch-lines` lines,
against `ladle up --workers N` on its own `redis-server` (AOF on, a spare port). Meanwhile:
a random worker is SIGKILLed every 20-40 s; at 30 % of the run one worker is SIGSTOPped for
3x its lease and resumed; at 50 % Redis is stopped (SIGTERM, AOF flushed) and started again;
at 70 % the API is sent SIGTERM (the supervisor restarts it). Then the load stops, every
accepted job is followed to a final state, and the ledger is printed: sent, completed, failed
by reason, lost (must be 0), duplicated or wrong outputs (0), batch lines answered (all), KV
blocks and running sequences left on every worker (0), 5xx other than documented 503s (0).
Exit code 1 if any of those is off. Everything is bounded in time and runs on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from ladle.broker import spare_port
from loadtest.chaos_load import PROMPTS, Clients, Ledger, poll_job, request_body
from loadtest.chaos_sweep import check_redis, run_batches, wait_idle
from loadtest.up import UpProcess, kill_child
from tests.support.harness import RedisServer

LEASE_S = 3.0  # LLM_WORKER_TTL_S: a worker silent this long loses its jobs' leases


@dataclass
class ChaosConfig:
    seconds: float = 600.0
    workers: int = 3
    clients: int = 6
    max_tokens: int = 16
    model: str = "tiny"
    kill_every: tuple[float, float] = (20.0, 40.0)
    batch_every: float = 90.0
    batch_lines: int = 20
    seed: int = 0


def service_env(config: ChaosConfig, redis_url: str, model_path: str) -> dict[str, str]:
    """`ladle up`'s settings for the run: short leases, room for many supervised crashes."""
    return {
        **os.environ,
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        "LLM_REDIS_URL": redis_url,
        "LLM_KEY_PREFIX": f"chaos-{uuid.uuid4().hex[:8]}",
        "LLM_MODEL_NAME": model_path,
        "LLM_DTYPE": "float32",
        "LLM_DEVICE": "cpu",
        "LLM_KV_CACHE_SIZE_MB": "16",
        "LLM_NUM_THREADS": "1",
        "LLM_WORKER_METRICS_PORT": "0",
        "LLM_SUPERVISOR_METRICS_PORT": "0",
        "LLM_HEARTBEAT_INTERVAL_S": "0.5",
        "LLM_WORKER_TTL_S": str(LEASE_S),
        "LLM_SHUTDOWN_TIMEOUT_S": "5",
        "LLM_JOB_MAX_TRIES": "5",
        # Being killed is the point of the run: never give up on a worker for it.
        "LLM_CRASH_LOOP_MAX_CRASHES": "1000",
        "LLM_LOG_LEVEL": "WARNING",
    }


def model_path(config: ChaosConfig, workdir: Path) -> str:
    """`tiny`: a tiny random Llama with a word-level tokenizer (the tests' model)."""
    if config.model != "tiny":
        return config.model
    from tests.support.engines import add_tiny_tokenizer
    from tests.support.tiny_models import tiny_model_dir

    path = tiny_model_dir("llama", workdir / "model", seed=11)
    add_tiny_tokenizer(path)
    return str(path)


class Faults:
    """The fault schedule, run as one task beside the load."""

    def __init__(self, up: UpProcess, redis: RedisServer, config: ChaosConfig, ledger: Ledger):
        self.up, self.redis, self.config, self.ledger = up, redis, config, ledger
        self.rng = random.Random(config.seed)

    def note(self, started: float, what: str) -> None:
        line = f"t={time.monotonic() - started:6.1f}s {what}"
        self.ledger.faults.append(line)
        print(line, flush=True)

    async def run(self, started: float, stop_at: float) -> None:
        duration = stop_at - started
        once = [(0.3, self.stop_a_worker), (0.5, self.restart_redis), (0.7, self.restart_api)]
        next_kill = started + self.rng.uniform(*self.config.kill_every)
        while time.monotonic() < stop_at:
            now = time.monotonic()
            if once and now - started >= once[0][0] * duration:
                await once.pop(0)[1](started)
            elif now >= next_kill:
                await self.kill_a_worker(started)
                next_kill = now + self.rng.uniform(*self.config.kill_every)
            await asyncio.sleep(0.2)

    def _workers(self) -> list[str]:
        children = self.up.children()
        return sorted(n for n, c in children.items() if n != "api" and c.state == "running")

    async def kill_a_worker(self, started: float) -> None:
        names = self._workers()
        if names:
            name = self.rng.choice(names)
            self.note(started, f"SIGKILL {name} (pid {kill_child(self.up, name)})")

    async def stop_a_worker(self, started: float) -> None:
        names = self._workers()
        if not names:
            return
        name = self.rng.choice(names)
        pid = kill_child(self.up, name, signal.SIGSTOP)
        self.note(started, f"SIGSTOP {name} (pid {pid}) for {3 * LEASE_S:.0f} s")
        await asyncio.sleep(3 * LEASE_S)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        self.note(started, f"SIGCONT {name}")

    async def restart_redis(self, started: float) -> None:
        self.note(started, "Redis SIGTERM (AOF flushed)")
        await asyncio.to_thread(self.redis.stop)
        await asyncio.sleep(2.0)
        await asyncio.to_thread(self.redis.start)
        self.note(started, "Redis started again")

    async def restart_api(self, started: float) -> None:
        self.note(started, f"API SIGTERM (pid {kill_child(self.up, 'api', signal.SIGTERM)})")


async def warm_up(clients: Clients, http: httpx.AsyncClient) -> None:
    """One calm answer per prompt and endpoint: the reference every later answer must equal."""
    for prompt in PROMPTS:
        for kind in ("sync", "stream"):
            await clients.one(http, kind, prompt)
    clients.ledger.sent = clients.ledger.completed = 0


async def settle(up: UpProcess, ledger: Ledger, http: httpx.AsyncClient) -> None:
    """Follow every job to a final state; then the workers must be idle, Redis consistent."""
    deadline = time.monotonic() + 300
    limit = asyncio.Semaphore(16)  # thousands of queued requests make httpx's pool crawl

    async def follow(job_id: str) -> dict | None:
        async with limit:
            return await poll_job(http, job_id, deadline)

    print(f"following up {len(ledger.job_ids)} jobs no client saw end", flush=True)
    results = await asyncio.gather(*(follow(job_id) for job_id in ledger.job_ids))
    # Jobs still not final are counted by check_redis (with those no client knew of).
    ledger.lost += sum(r is not None and r["status"] == "missing" for r in results)
    await wait_idle(up, http, ledger)
    await asyncio.to_thread(check_redis, up, ledger)


async def run(config: ChaosConfig, workdir: Path) -> Ledger:
    redis = RedisServer(workdir / "redis", aof=True)  # appendfsync everysec
    redis.start()
    env = service_env(config, redis.url, model_path(config, workdir))
    up = UpProcess(env, spare_port(), config.workers, workdir / "up.log")
    up.start()
    ledger = Ledger()
    try:
        async with httpx.AsyncClient(base_url=up.base_url, timeout=120) as http:
            await asyncio.to_thread(up.wait_ready, httpx.Client(timeout=10), config.workers)
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            clients = Clients(up.base_url, model, config.max_tokens, ledger, seed=config.seed)
            await warm_up(clients, http)
            started = time.monotonic()
            stop_at = started + config.seconds
            await asyncio.gather(
                clients.run(config.clients, stop_at),
                Faults(up, redis, config, ledger).run(started, stop_at),
                run_batches(http, model, config, ledger, stop_at),
            )
            await settle(up, ledger, http)
    finally:
        up.stop()
        redis.stop()
    return ledger


def markdown(ledger: Ledger, config: ChaosConfig) -> str:
    failed = ", ".join(f"{k} x {v}" for k, v in sorted(ledger.failed.items())) or "none"
    rows = [
        (
            "duration, workers, clients",
            f"{config.seconds:.0f} s, {config.workers}, {config.clients}",
        ),
        ("requests sent", ledger.sent),
        ("completed (text equal to the reference)", ledger.completed),
        ("failed, by reason", failed),
        ("lost", ledger.lost),
        ("duplicated / wrong outputs", f"{ledger.duplicated} / {ledger.wrong_text}"),
        ("batch lines sent / answered", f"{ledger.batch_lines} / {ledger.batch_lines_answered}"),
        ("KV blocks left per worker", ledger.kv_blocks_left),
        ("running sequences left per worker", ledger.running_left),
        ("5xx other than documented 503s", ledger.undocumented_5xx),
    ]
    return "\n".join(["| figure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--model", default="tiny", help="`tiny` (default) or a model name/path")
    parser.add_argument("--batch-every", type=float, default=90.0)
    parser.add_argument("--batch-lines", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the ledger here too")
    args = parser.parse_args(argv)
    config = ChaosConfig(
        seconds=args.seconds,
        workers=args.workers,
        clients=args.clients,
        max_tokens=args.max_tokens,
        model=args.model,
        batch_every=args.batch_every,
        batch_lines=args.batch_lines,
        seed=args.seed,
    )
    with tempfile.TemporaryDirectory(prefix="ladle-chaos-") as tmp:
        ledger = asyncio.run(run(config, Path(tmp)))
    print(markdown(ledger, config))
    if args.json:
        args.json.write_text(json.dumps(ledger.as_dict(), indent=2, default=str))
    problems = ledger.problems()
    for problem in problems:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    for detail in ledger.details:
        print(f"  {detail}", file=sys.stderr)
    return 1 if problems else 0


__all__ = ["ChaosConfig", "Ledger", "main", "request_body", "run"]

if __name__ == "__main__":
    raise SystemExit(main())

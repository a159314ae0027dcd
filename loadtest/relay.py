"""How many tokens/s the token relay carries through Redis, without a model.

Synthetic workers (each a real `worker.publisher.Publisher` over a real
`worker.job_writer.JobWriter`, fed `SequenceOutput`s the way the engine thread feeds them: one
token for each of its `--batch` streams per step, `--rate` steps a second) publish to N
concurrent streams; reader processes run the real `api.jobs.relay.Relay` (one multiplexed XREAD
per stream shard and process, as in an API process) with one subscriber per stream. Every
delta's text is its publish time, so each reader measures publish-to-client latency. Redis's
own CPU comes from `INFO cpu` over the measured window.

    python -m loadtest.relay --streams 100,1000,5000 --seconds 20 --json relay.json
    python -m loadtest.relay --streams 1000 --shards 1,2,3      # LLM_RELAY_REDIS_URLS

Each level gets fresh private redis-servers (persistence off) on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import resource
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import redis
import redis.asyncio

from api.jobs.relay import Relay
from shared.contracts import DeltaEvent, JobPayload
from shared.keys import Keys
from shared.relay_shards import StreamShards
from tests.support.redis_topology import redis_shards
from worker.engine.engine import SequenceOutput
from worker.job_state import JobState
from worker.job_writer import JobWriter
from worker.publisher import Publisher

PREFIX = "relaybench"
MAX_SECONDS = 300  # every level is bounded whatever the flags say


@dataclass(frozen=True)
class Level:
    """One measured load: `num_streams` streams at `rate` tokens/s each."""

    num_streams: int
    rate: float
    batch: int
    seconds: float
    warmup_s: float
    num_publishers: int
    num_readers: int
    redis_url: str
    shard_urls: tuple[str, ...] = ()  # LLM_RELAY_REDIS_URLS; empty: streams on redis_url


@dataclass
class Result:
    num_streams: int
    offered_tokens_per_s: float
    delivered_tokens_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    redis_cpu_cores: float
    client_cpu_cores: float
    redis_cpu_us_per_token: float  # per published token: one XADD, read once by a relay
    extra: dict = field(default_factory=dict)


def job_id(index: int) -> str:
    return f"job-relay-{index:06d}"


def _payload(index: int) -> JobPayload:
    return JobPayload(id=job_id(index), endpoint="completions", model="bench", prompt_token_ids=[1])


class SyntheticWorker:
    """A worker without a model: its 'engine' gives each of its jobs one token per step."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        shards: StreamShards,
        job_indexes: list[int],
        window: tuple[float, float],
    ) -> None:
        loop = asyncio.get_running_loop()
        self.jobs = {job_id(i): JobState.create(_payload(i), 1, [1], loop) for i in job_indexes}
        store = JobWriter(client, Keys(PREFIX), 600, 10_000, shards=shards)
        self.publisher = Publisher(client, store, self.jobs, None, lambda _job: None)  # type: ignore[arg-type]
        self.window = window
        self.num_published = 0  # within the measured window

    def step(self) -> None:
        now = time.time()
        outputs = [
            SequenceOutput(job.engine_request_id, 0, f"{now:.6f}", [7], None, None, 1, 1, 0)
            for job in self.jobs.values()
        ]
        if self.window[0] <= now < self.window[1]:
            self.num_published += len(outputs)
        self.publisher.on_outputs(outputs)


async def _publish(level: Level, job_indexes: list[int], start_at: float) -> dict:
    client = redis.asyncio.Redis.from_url(level.redis_url)
    shards = StreamShards(client, list(level.shard_urls))
    groups = [job_indexes[i : i + level.batch] for i in range(0, len(job_indexes), level.batch)]
    end_at = start_at + level.seconds
    window = (start_at + level.warmup_s, end_at)
    workers = [SyntheticWorker(client, shards, group, window) for group in groups]
    runners = [asyncio.create_task(w.publisher.run()) for w in workers]
    await asyncio.sleep(max(0.0, start_at - time.time()))
    period, next_at = 1.0 / level.rate, time.monotonic()
    while time.time() < end_at:
        for worker in workers:
            worker.step()
        next_at += period
        delay = next_at - time.monotonic()
        if delay < 0:  # behind: drop the missed steps rather than burst (like a slow engine)
            next_at = time.monotonic()
        await asyncio.sleep(max(delay, 0.0))
    for runner in runners:
        runner.cancel()
    await shards.aclose()
    await client.aclose()
    return {"published_in_window": sum(w.num_published for w in workers)}


async def _read(level: Level, job_indexes: list[int], start_at: float) -> dict:
    client = redis.asyncio.Redis.from_url(level.redis_url)
    shards = StreamShards(client, list(level.shard_urls))
    relay = Relay(client, Keys(PREFIX), shards=shards)
    reads = _count_reads(shards.clients)
    measure_at, end_at = start_at + level.warmup_s, start_at + level.seconds
    latencies: list[float] = []
    counts = [0]

    async def consume(index: int) -> None:
        sub = relay.subscribe(job_id(index))
        while (left := end_at - time.time()) > 0:
            try:
                _, event = await sub.next(timeout=left)
            except TimeoutError:
                break
            now = time.time()
            if isinstance(event, DeltaEvent) and now >= measure_at:
                counts[0] += 1
                if counts[0] % 7 == 0:  # a sample keeps the reader's own cost down
                    latencies.append(now - float(event.text))

    await asyncio.gather(*(consume(i) for i in job_indexes))
    await relay.stop()
    await client.aclose()
    return {"delivered_in_window": counts[0], "latencies": latencies, **reads}


def _count_reads(clients: list[redis.asyncio.Redis]) -> dict[str, int]:
    """Counts the relay's XREAD calls and the entries they return (what a read costs)."""
    counts = {"num_reads": 0, "num_entries_read": 0}
    for client in clients:
        xread = client.xread

        async def counted(*args: object, _xread=xread, **kwargs: object) -> object:  # noqa: ANN001
            replies = await _xread(*args, **kwargs)
            counts["num_reads"] += 1
            counts["num_entries_read"] += sum(len(entries) for _, entries in replies or [])
            return replies

        client.xread = counted  # type: ignore[method-assign]
    return counts


def _process_main(kind: str, level: Level, job_indexes: list[int], pipe: Connection) -> None:
    """One publisher or reader process: imports done, it says so, then waits for the start."""
    pipe.send("ready")
    start_at = pipe.recv()
    work = _publish if kind == "publish" else _read
    result = asyncio.run(work(level, job_indexes, start_at))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["cpu_s"] = usage.ru_utime + usage.ru_stime
    pipe.send(result)


def _redis_cpu_s(urls: tuple[str, ...]) -> list[float]:
    """CPU seconds (user + sys) each Redis has used so far."""
    infos = [redis.Redis.from_url(url).info("cpu") for url in urls]
    return [float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos]


def _split(indexes: list[int], parts: int) -> list[list[int]]:
    return [indexes[i::parts] for i in range(parts)]


def run_level(level: Level) -> Result:
    indexes = list(range(level.num_streams))
    ctx = mp.get_context("spawn")  # fresh interpreters, like separate workers and APIs
    procs = []
    for kind, parts in (("read", level.num_readers), ("publish", level.num_publishers)):
        for share in _split(indexes, parts):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_process_main, args=(kind, level, share, theirs))
            proc.start()
            procs.append((kind, ours, proc))
    for _, pipe, _ in procs:
        assert pipe.recv() == "ready"
    start_at = time.time() + 1.0 + level.num_streams / 2000  # subscriptions set up by then
    for _, pipe, _ in procs:
        pipe.send(start_at)
    time.sleep(max(0.0, start_at + level.warmup_s - time.time()))
    stream_redis = level.shard_urls or (level.redis_url,)
    cpu_before, window_at = _redis_cpu_s(stream_redis), time.time()
    time.sleep(max(0.0, start_at + level.seconds - time.time()))
    elapsed = time.time() - window_at
    redis_cpu = [
        (after - before) / elapsed
        for before, after in zip(cpu_before, _redis_cpu_s(stream_redis), strict=True)
    ]
    parts = [(kind, pipe.recv()) for kind, pipe, _ in procs]
    for _, _, proc in procs:
        proc.join(timeout=60)
    return _combine(level, parts, redis_cpu)


def _combine(level: Level, parts: list[tuple[str, dict]], per_shard_cpu: list[float]) -> Result:
    window = level.seconds - level.warmup_s
    redis_cpu = sum(per_shard_cpu)
    delivered = sum(p["delivered_in_window"] for k, p in parts if k == "read") / window
    offered = sum(p["published_in_window"] for k, p in parts if k == "publish") / window
    latencies = sorted(x for k, p in parts if k == "read" for x in p["latencies"])
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 100 else [0.0] * 99
    return Result(
        num_streams=level.num_streams,
        offered_tokens_per_s=round(offered),
        delivered_tokens_per_s=round(delivered),
        latency_p50_ms=round(quantiles[49] * 1000, 2),
        latency_p99_ms=round(quantiles[98] * 1000, 2),
        redis_cpu_cores=round(redis_cpu, 3),
        client_cpu_cores=round(sum(p["cpu_s"] for _, p in parts) / level.seconds, 2),
        redis_cpu_us_per_token=round(redis_cpu * 1e6 / offered, 2) if offered else 0.0,
        extra={
            "reads_per_s": round(sum(p.get("num_reads", 0) for _, p in parts) / level.seconds),
            "num_shards": len(level.shard_urls),
            "redis_cpu_cores_per_shard": [round(c, 3) for c in per_shard_cpu],
            "entries_per_read": round(
                sum(p.get("num_entries_read", 0) for _, p in parts)
                / max(1, sum(p.get("num_reads", 0) for _, p in parts)),
                1,
            ),
        },
    )


def _measure(args: argparse.Namespace, seconds: float, num_streams: int, num_shards: int) -> Result:
    """One level on fresh redis-servers: the main one, and `num_shards` for the streams."""
    with redis_shards(1 + num_shards) as (main, *shards):
        level = Level(
            num_streams,
            args.rate,
            args.batch,
            seconds,
            min(args.warmup_s, seconds / 2),
            args.publishers,
            args.readers,
            main.url,
            tuple(node.url for node in shards),
        )
        return run_level(level)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="100,1000,5000", help="comma-separated levels")
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--batch", type=int, default=32, help="streams per synthetic worker")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--publishers", type=int, default=2, help="publishing processes")
    parser.add_argument("--readers", type=int, default=2, help="relay processes (API-like)")
    parser.add_argument(
        "--shards",
        default="0",
        help="comma-separated shard counts (LLM_RELAY_REDIS_URLS); 0: the streams on one Redis",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    # A SIGTERM (`timeout`) must still unwind the `with` that stops our redis-servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seconds = min(args.seconds, MAX_SECONDS)
    results = []
    for num_shards in (int(n) for n in args.shards.split(",")):
        for num_streams in (int(n) for n in args.streams.split(",")):
            result = _measure(args, seconds, num_streams, num_shards)
            print(json.dumps(asdict(result)), flush=True)
            results.append(asdict(result))
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "args": vars(args) | {"json": str(args.json)},
                    "results": results,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

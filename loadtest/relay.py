"""How many tokens/s the token relay carries through Redis, without a model.

Publisher processes stand for workers: one token for each of their streams per step, `--rate`
steps a second, `--batch` streams per synthetic worker. Reader processes stand for API
processes: one multiplexed XREAD per read group (a Redis, a shard, a cluster slot group) with
one subscriber per stream. Every event's text is its publish time, so readers measure
publish-to-client latency; each process reports its own CPU, and each Redis its `INFO cpu`,
over the measured window. Two kinds of client (`--client`):

- `real`: the real `worker.publisher.Publisher` over `worker.job_writer.JobWriter`, and the
  real `api.jobs.relay.Relay` with asyncio subscribers: what Ladle's own code carries.
- `raw`: `loadtest/relay_raw.py`, the same Redis commands (pipelined XADDs, steps coalesced
  while Redis lags; one XREAD BLOCK per group) over plain sockets: what Redis carries.

    python -m loadtest.relay --client raw --streams 100,1000,5000 --rates 20,100,400
    python -m loadtest.relay --client raw --streams 1000 --rates 100 --shards 0,1,2,3,cluster
    python -m loadtest.relay --client real --streams 100,1000 --rates 20

Each level gets fresh private redis-servers (persistence off) on 127.0.0.1 (`--port-base`
picks their ports); `--shards N` spreads the streams over N of them (LLM_RELAY_REDIS_URLS),
`cluster` over a 3-master Redis Cluster (LLM_RELAY_REDIS_CLUSTER_URL).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path

import redis
from redis.crc import key_slot

from loadtest.relay_raw import Plan, Window, job_id, raw_process_main
from shared.keys import Keys, group_tag
from shared.relay_shards import CLUSTER_STREAM_GROUPS, shard_of
from tests.support.redis_topology import redis_cluster, redis_shards

PREFIX = "relaybench"  # our processes never import torch: fast to spawn on a loaded machine
MAX_SECONDS = 300  # every level is bounded whatever the flags say
STREAM_MAXLEN = 10_000
RESULT_WAIT_S = 120.0  # a process's setup or its report after the window
CLUSTER_MASTERS = 3


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
    client: str = "real"
    shard_urls: tuple[str, ...] = ()  # LLM_RELAY_REDIS_URLS; empty: streams on redis_url
    cluster_url: str | None = None  # LLM_RELAY_REDIS_CLUSTER_URL
    plan: Plan | None = None  # raw clients: where each stream lives

    @property
    def keys(self) -> Keys:
        return Keys(PREFIX, stream_groups=CLUSTER_STREAM_GROUPS if self.cluster_url else 0)


@dataclass
class Result:
    topology: str
    client: str
    num_streams: int
    rate_per_stream: float
    offered_tokens_per_s: float
    delivered_tokens_per_s: float
    latency_p50_ms: float
    latency_p99_ms: float
    redis_cpu_cores: float
    publisher_cpu_cores: float
    reader_cpu_cores: float
    redis_cpu_us_per_token: float  # per delivered token: one XADD, read once by a relay
    extra: dict = field(default_factory=dict)


def _process_args(kind: str, level: Level, share: list[int], pipe: Connection) -> tuple:
    """The target and arguments of a process; raw ones never import torch (fast to start)."""
    if level.client == "raw":
        return raw_process_main, (kind, level.plan, share, level.rate, STREAM_MAXLEN, pipe)
    from loadtest.relay_real import real_process_main  # imports torch

    return real_process_main, (kind, level, share, pipe)


def _redis_cpu_s(urls: tuple[str, ...]) -> list[float]:
    """CPU seconds (user + sys) each Redis has used so far."""
    infos = [redis.Redis.from_url(url).info("cpu") for url in urls]
    return [float(i["used_cpu_user"]) + float(i["used_cpu_sys"]) for i in infos]


def _split(indexes: list[int], parts: int) -> list[list[int]]:
    return [indexes[i::parts] for i in range(parts)]


def run_level(level: Level, stream_redis: tuple[str, ...]) -> Result:
    indexes = list(range(level.num_streams))
    ctx = mp.get_context("spawn")  # fresh interpreters, like separate workers and APIs
    procs = []
    for kind, parts in (("read", level.num_readers), ("publish", level.num_publishers)):
        for share in _split(indexes, parts):
            ours, theirs = ctx.Pipe()
            target, process_args = _process_args(kind, level, share, theirs)
            proc = ctx.Process(target=target, args=process_args, daemon=True)
            proc.start()
            theirs.close()  # a child that dies is then an EOFError here, not a hang
            procs.append((kind, ours, proc))
    for _, pipe, _ in procs:
        assert _receive(pipe, RESULT_WAIT_S) == "ready"
    start_at = time.time() + 1.0 + level.num_streams / 2000  # subscriptions set up by then
    window = Window(start_at, start_at + level.warmup_s, start_at + level.seconds)
    for _, pipe, _ in procs:
        pipe.send(window)
    time.sleep(max(0.0, window.measure_at - time.time()))
    cpu_before, load_before = _redis_cpu_s(stream_redis), os.getloadavg()[0]
    time.sleep(max(0.0, window.end_at - time.time()))
    cpu_after, load_after = _redis_cpu_s(stream_redis), os.getloadavg()[0]
    span = window.end_at - window.measure_at
    redis_cpu = [
        (after - before) / span for before, after in zip(cpu_before, cpu_after, strict=True)
    ]
    parts = [(kind, _receive(pipe, RESULT_WAIT_S)) for kind, pipe, _ in procs]
    for _, _, proc in procs:
        proc.join(timeout=60)
    return _combine(level, parts, redis_cpu, span, (load_before, load_after))


def _receive(pipe: Connection, timeout_s: float) -> object:
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"a load process did not answer within {timeout_s:.0f} s")
    return pipe.recv()


def _combine(
    level: Level,
    parts: list[tuple[str, dict]],
    per_server_cpu: list[float],
    span: float,
    loads: tuple[float, float],
) -> Result:
    def total(kind: str, name: str) -> float:
        return sum(p.get(name, 0) for k, p in parts if k == kind)

    redis_cpu = sum(per_server_cpu)
    delivered = total("read", "delivered") / span
    latencies = sorted(x for k, p in parts if k == "read" for x in p["latencies"])
    quantiles = statistics.quantiles(latencies, n=100) if len(latencies) > 100 else [0.0] * 99
    reads = total("read", "reads")

    def us_per_token(kind: str) -> float:  # the clients' cost, finer than cores at low rates
        return round(total(kind, "cpu_s") / span * 1e6 / delivered, 1) if delivered else 0.0

    return Result(
        topology=_topology_name(level),
        client=level.client,
        num_streams=level.num_streams,
        rate_per_stream=level.rate,
        offered_tokens_per_s=round(level.num_streams * level.rate),
        delivered_tokens_per_s=round(delivered),
        latency_p50_ms=round(quantiles[49] * 1000, 2),
        latency_p99_ms=round(quantiles[98] * 1000, 2),
        redis_cpu_cores=round(redis_cpu, 3),
        publisher_cpu_cores=round(total("publish", "cpu_s") / span, 2),
        reader_cpu_cores=round(total("read", "cpu_s") / span, 2),
        redis_cpu_us_per_token=round(redis_cpu * 1e6 / delivered, 2) if delivered else 0.0,
        extra={
            "published_tokens_per_s": round(total("publish", "published") / span),
            "dropped_tokens_per_s": round(total("publish", "dropped") / span),
            "publish_errors": total("publish", "errors"),
            "publisher_cpu_us_per_token": us_per_token("publish"),
            "reader_cpu_us_per_token": us_per_token("read"),
            "redis_cpu_cores_per_server": [round(c, 3) for c in per_server_cpu],
            "cpu_cores_per_process": {
                f"{k}{i}": round(p["cpu_s"] / span, 2) for i, (k, p) in enumerate(parts)
            },
            "reads_per_s": round(reads / span),
            "entries_per_read": round(total("read", "entries_read") / max(1, reads), 1),
            "load_average": [round(x, 1) for x in loads],
        },
    )


def _topology_name(level: Level) -> str:
    if level.cluster_url:
        return f"cluster of {CLUSTER_MASTERS}"
    return f"{len(level.shard_urls)} shards" if level.shard_urls else "one Redis"


def _plan(keys: Keys, num_streams: int, targets: list[tuple[str, int]], cluster: object) -> Plan:
    """Raw clients' map: each stream's read group, and the Redis of each group."""
    stream_keys = [keys.stream(job_id(i)) for i in range(num_streams)]
    if cluster is not None:  # a group's Redis is the master of its tag's slot
        owners = [
            cluster.owner(key_slot(group_tag(g, CLUSTER_STREAM_GROUPS).encode()))  # type: ignore[attr-defined]
            for g in range(CLUSTER_STREAM_GROUPS)
        ]
        groups = [shard_of(key, CLUSTER_STREAM_GROUPS) for key in stream_keys]
        return Plan(stream_keys, groups, [("127.0.0.1", node.port) for node in owners])
    groups = [shard_of(key, len(targets)) for key in stream_keys]
    return Plan(stream_keys, groups, targets)


def _measure(args: argparse.Namespace, num_streams: int, rate: float, shards: str) -> Result:
    """One level on fresh redis-servers: the main one, and the stream shards or cluster."""
    num_shards = 0 if shards == "cluster" else int(shards)
    ports = [args.port_base + i for i in range(1 + num_shards)] if args.port_base else None
    with redis_shards(1 + num_shards, ports=ports) as (main, *shard_nodes):
        if shards != "cluster":
            return _run(args, num_streams, rate, main.url, shard_nodes or [main], None)
        base = args.port_base + 10 if args.port_base else None
        cluster_ports = [base + i for i in range(CLUSTER_MASTERS)] if base else None
        with redis_cluster(CLUSTER_MASTERS, ports=cluster_ports) as cluster:
            return _run(args, num_streams, rate, main.url, cluster.masters, cluster)


def _run(args, num_streams, rate, main_url, stream_nodes, cluster) -> Result:  # noqa: ANN001
    is_sharded = cluster is None and stream_nodes[0].url != main_url
    level = Level(
        num_streams,
        rate,
        args.batch,
        min(args.seconds, MAX_SECONDS),
        min(args.warmup_s, args.seconds / 2),
        args.publishers,
        args.readers,
        main_url,
        args.client,
        tuple(node.url for node in stream_nodes) if is_sharded else (),
        cluster.url if cluster is not None else None,
    )
    if args.client == "raw":
        targets = [("127.0.0.1", node.port) for node in stream_nodes]
        level = replace(level, plan=_plan(level.keys, num_streams, targets, cluster))
    return run_level(level, tuple(node.url for node in stream_nodes))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--client",
        choices=("real", "raw"),
        default="real",
        help="real: Ladle's Publisher and Relay; raw: the same commands over plain sockets",
    )
    parser.add_argument("--streams", default="100,1000,5000", help="comma-separated levels")
    parser.add_argument("--rates", default="20", help="comma-separated tokens/s per stream")
    parser.add_argument(
        "--batch", type=int, default=32, help="streams per synthetic worker (real clients)"
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--publishers", type=int, default=2, help="publishing processes")
    parser.add_argument("--readers", type=int, default=2, help="relay processes (API-like)")
    parser.add_argument(
        "--shards",
        default="0",
        help="comma-separated: 0 (streams on the one Redis), N (N shards, "
        "LLM_RELAY_REDIS_URLS) or cluster (3 masters, LLM_RELAY_REDIS_CLUSTER_URL)",
    )
    parser.add_argument("--port-base", type=int, default=0, help="ports from here; 0: any free")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    # A SIGTERM (`timeout`) must still unwind the `with` that stops our redis-servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = []
    for shards in args.shards.split(","):
        for num_streams in (int(n) for n in args.streams.split(",")):
            for rate in (float(r) for r in args.rates.split(",")):
                result = asdict(_measure(args, num_streams, rate, shards))
                print(json.dumps(result), flush=True)
                results.append(result)
    if args.json:
        machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()}
        report = {"machine": machine, "args": vars(args) | {"json": str(args.json)}}
        args.json.write_text(json.dumps(report | {"results": results}, indent=1))


if __name__ == "__main__":
    main()

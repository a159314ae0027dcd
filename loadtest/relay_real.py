"""The real clients of `loadtest.relay`: Ladle's own publisher and relay (imports torch)."""

from __future__ import annotations

import asyncio
import time
from multiprocessing.connection import Connection

import redis.asyncio

from api.jobs.relay import Relay
from loadtest.relay import STREAM_MAXLEN, Level
from loadtest.relay_raw import Window, cpu_s, job_id
from shared.contracts import DeltaEvent, JobPayload
from shared.keys import Keys
from shared.redis_wire import pack_in_c
from shared.relay_shards import StreamShards
from worker.engine.engine import SequenceOutput
from worker.job_state import JobState
from worker.job_writer import JobWriter
from worker.publisher import Publisher


def _payload(index: int) -> JobPayload:
    return JobPayload(id=job_id(index), endpoint="completions", model="bench", prompt_token_ids=[1])


class SyntheticWorker:
    """A worker without a model: its 'engine' gives each of its jobs one token per step."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        shards: StreamShards,
        keys: Keys,
        job_indexes: list[int],
        window: tuple[float, float],
    ) -> None:
        loop = asyncio.get_running_loop()
        self.jobs = {job_id(i): JobState.create(_payload(i), 1, [1], loop) for i in job_indexes}
        store = JobWriter(client, keys, 600, STREAM_MAXLEN, shards=shards)
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


def _clients(level: Level) -> tuple[redis.asyncio.Redis, StreamShards]:
    client = redis.asyncio.Redis.from_url(level.redis_url)
    return client, StreamShards(client, list(level.shard_urls), level.cluster_url)


async def _cpu_at(when: float) -> float:
    await asyncio.sleep(max(0.0, when - time.time()))
    return cpu_s()


async def _publish(level: Level, job_indexes: list[int], window: Window) -> dict:
    client, shards = _clients(level)
    groups = [job_indexes[i : i + level.batch] for i in range(0, len(job_indexes), level.batch)]
    span = (window.measure_at, window.end_at)
    workers = [SyntheticWorker(client, shards, level.keys, g, span) for g in groups]
    runners = [asyncio.create_task(w.publisher.run()) for w in workers]
    cpu_mark = asyncio.create_task(_cpu_at(window.measure_at))
    await asyncio.sleep(max(0.0, window.start_at - time.time()))
    period, next_at = 1.0 / level.rate, time.monotonic()
    while time.time() < window.end_at:
        for worker in workers:
            worker.step()
        next_at += period
        delay = next_at - time.monotonic()
        if delay < 0:  # behind: drop the missed steps rather than burst (like a slow engine)
            next_at = time.monotonic()
        await asyncio.sleep(max(delay, 0.0))
    cpu_used = cpu_s() - await cpu_mark
    for runner in runners:
        runner.cancel()
    await shards.aclose()
    await client.aclose()
    return {"published": sum(w.num_published for w in workers), "cpu_s": cpu_used}


async def _read(level: Level, job_indexes: list[int], window: Window) -> dict:
    client, shards = _clients(level)
    relay = Relay(client, level.keys, shards=shards)
    reads = _count_reads(shards.clients)
    latencies: list[float] = []
    counts = [0]

    async def consume(index: int) -> None:
        sub = relay.subscribe(job_id(index))
        while (left := window.end_at - time.time()) > 0:
            try:
                _, event = await sub.next(timeout=left)
            except TimeoutError:
                break
            now = time.time()
            if isinstance(event, DeltaEvent) and now >= window.measure_at:
                counts[0] += 1
                if counts[0] % 7 == 0:  # a sample keeps the reader's own cost down
                    latencies.append(now - float(event.text))

    cpu_mark = asyncio.create_task(_cpu_at(window.measure_at))
    await asyncio.gather(*(consume(i) for i in job_indexes))
    cpu_used = cpu_s() - await cpu_mark
    await relay.stop()
    await shards.aclose()
    await client.aclose()
    return {"delivered": counts[0], "latencies": latencies, "cpu_s": cpu_used, **reads}


def _count_reads(clients: list) -> dict[str, int]:
    """Counts the relay's XREAD calls and the entries they return (what a read costs)."""
    counts = {"reads": 0, "entries_read": 0}
    for client in clients:
        method = "execute_command" if hasattr(client, "nodes_manager") else "xread"
        original = getattr(client, method)

        async def counted(*args: object, _call=original, _m=method, **kwargs: object) -> object:  # noqa: ANN001
            replies = await _call(*args, **kwargs)
            if _m == "xread" or args[:1] == ("XREAD",):
                counts["reads"] += 1
                counts["entries_read"] += sum(len(entries) for _, entries in replies or [])
            return replies

        setattr(client, method, counted)
    return counts


def real_process_main(kind: str, level: Level, job_indexes: list[int], pipe: Connection) -> None:
    """One real publisher or reader process: says it is ready, then waits for the start."""
    pack_in_c()  # as the API and worker processes do
    pipe.send("ready")
    window = pipe.recv()
    work = _publish if kind == "publish" else _read
    pipe.send(asyncio.run(work(level, job_indexes, window)))

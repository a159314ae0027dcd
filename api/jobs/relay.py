"""One multiplexed Redis Streams reader per API process.

A single background task (one per stream shard, `LLM_RELAY_REDIS_URLS`, or per cluster slot
group, `LLM_RELAY_REDIS_CLUSTER_URL`) runs `XREAD BLOCK` over every stream that has
subscribers and fans the entries out to per-subscriber asyncio queues. A new subscriber's
stream that the read in flight does not cover gets a second read of its own at once (at most
`MAX_READS` per group), so a short job's answer does not wait out the first read's block
(`block_ms`); entries already in a stream are replayed from the subscriber's last id, so
subscribing after enqueueing loses nothing, and an entry read twice is delivered once.

Faults end waits instead of leaving them hanging: a job whose record is gone after Redis came
back (a restart without persistence), a Redis outage longer than `outage_grace_s`, and the
API shutting down each deliver an `ErrorEvent` (503) to the subscribers concerned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.contracts import TERMINAL_EVENT_TYPES, ErrorEvent, StreamEvent, decode_event
from shared.keys import Keys
from shared.relay_shards import StreamShards
from shared.retry import FOREVER, Backoff, retry

log = logging.getLogger(__name__)
READ_BACKOFF = Backoff(first_s=0.05, max_s=2.0)
# Reads in flight per stream group: the long-blocking one and one for streams new since it
# began (docs/benchmarks.md, "Embeddings at batch 1": waiting out the block cost ~40 ms).
MAX_READS = 2


def parse_entry_id(entry_id: str) -> tuple[int, int]:
    """'1700000000000-3' -> (1700000000000, 3); ValueError if malformed."""
    ms, _, seq = entry_id.partition("-")
    if not ms.isdigit() or (seq and not seq.isdigit()):
        raise ValueError(f"not a stream entry id: {entry_id!r}")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Subscription:
    """One reader of one job's events, from after `last_id`.

    At most `max_buffered` events wait in memory: a reader that falls behind (a slow client
    behind a full socket) is paused, and the relay stops reading its stream for it; the
    entries wait in Redis and are read again once it has taken half of its backlog. So a
    slow client costs the API a bounded amount of memory and the worker nothing."""

    job_id: str
    stream: str
    last_id: str = "0-0"
    max_buffered: int = 256
    on_resume: Callable[[], None] = lambda: None
    is_paused: bool = False
    is_ended: bool = False  # its job's last event (done, error) is delivered: nothing follows
    queue: asyncio.Queue[tuple[str, StreamEvent]] = field(default_factory=asyncio.Queue)

    async def next(self, timeout: float | None) -> tuple[str, StreamEvent]:
        """The next (entry id, event); raises TimeoutError."""
        if self.queue.empty():  # a timeout scope, not wait_for: that wraps each get in a task
            async with asyncio.timeout(timeout):
                item = await self.queue.get()
        else:
            item = self.queue.get_nowait()
        if self.is_paused and self.queue.qsize() <= self.max_buffered // 2:
            self.is_paused = False
            self.on_resume()
        return item

    def fail(self, event: ErrorEvent) -> None:
        """End this reader's wait with an error that did not come from the stream."""
        self.queue.put_nowait((self.last_id, event))

    def _offer(self, entry_id: str, event: StreamEvent | None) -> bool:
        """Deliver an entry past our position; None (undecodable) only moves the position.
        False when the buffer is full: the entry is left in Redis for later."""
        if parse_entry_id(entry_id) <= parse_entry_id(self.last_id):
            return True
        if event is not None and self.queue.qsize() >= self.max_buffered:
            self.is_paused = True
            return False
        self.last_id = entry_id
        if event is not None:
            self.queue.put_nowait((entry_id, event))
            self.is_ended = event.type in TERMINAL_EVENT_TYPES
        return True


class Relay:
    """The process's stream reader; `subscribe`/`unsubscribe` are cheap and synchronous."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        block_ms: int = 50,
        verify_delay_s: float = 2.0,
        outage_grace_s: float = 30.0,
        max_buffered: int = 256,
        shards: StreamShards | None = None,
    ) -> None:
        self.redis = redis
        self.shards = shards or StreamShards(redis, [])  # one reader task per stream group
        self.keys = keys
        self.block_ms = block_ms
        self.verify_delay_s = verify_delay_s  # after a reconnect: workers restore records
        self.outage_grace_s = outage_grace_s
        self.max_buffered = max_buffered
        self.healthy = True
        self.closing = False  # the API is shutting down
        self._closed = False  # ... and open waits have been ended
        self._lost_since: float | None = None
        self._subs: dict[str, set[Subscription]] = {}
        self._streams_by_group: list[set[str]] = [set() for _ in range(self.shards.num_groups)]
        self._wakes = [asyncio.Event() for _ in range(self.shards.num_groups)]
        # each group's reads in flight -> the streams each one reads
        self._reads: list[dict[asyncio.Task[list], set[str]]] = [
            {} for _ in range(self.shards.num_groups)
        ]
        self._tasks: list[asyncio.Task] = []
        self._checks: set[asyncio.Task] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False

    def subscribe(self, job_id: str, last_id: str = "0-0") -> Subscription:
        parse_entry_id(last_id)
        stream = self.keys.stream(job_id)
        group = self.shards.group(stream)
        wake = self._wakes[group]
        sub = Subscription(job_id, stream, last_id, self.max_buffered, wake.set)
        self._subs.setdefault(sub.stream, set()).add(sub)
        self._streams_by_group[group].add(stream)
        if self._closed:
            sub.fail(shutdown_error(job_id))
        wake.set()
        self.start()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.stream)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.stream]
                self._streams_by_group[self.shards.group(sub.stream)].discard(sub.stream)

    @property
    def num_buffered(self) -> int:
        """Events read from Redis that clients have not taken yet (bounded per reader)."""
        return sum(sub.queue.qsize() for subs in self._subs.values() for sub in subs)

    @property
    def num_paused(self) -> int:
        """Readers paused because their client fell behind."""
        return sum(sub.is_paused for subs in self._subs.values() for sub in subs)

    def _positions(self, group: int) -> dict[str, str]:
        """Where to read each of a group's streams from: the earliest reader not paused and
        not ended (a read of an ended stream would only block a read slot for `block_ms`)."""
        positions = {}
        for stream in self._streams_by_group[group]:
            active = [s for s in self._subs.get(stream, ()) if not s.is_paused and not s.is_ended]
            if active:
                positions[stream] = min((s.last_id for s in active), key=parse_entry_id)
        return positions

    def start(self) -> None:
        if not self._tasks and not self._stopping:
            self._loop = asyncio.get_running_loop()
            self._tasks = [
                asyncio.create_task(self._run(group), name=f"stream-relay-{group}")
                for group in range(len(self._wakes))
            ]

    async def stop(self) -> None:
        self._stopping = True  # redis-py may turn a cancelled read into a ConnectionError
        for task in [*self._tasks, *self._checks]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._tasks = []

    def begin_shutdown(self, grace_s: float) -> None:
        """The API is stopping: open waits may go on for `grace_s`, then end with a 503
        (the jobs themselves go on; clients fetch them by id). Safe from a signal handler."""
        if self.closing:
            return
        self.closing = True
        log.info("shutting down: open streams get %.1f s to finish", grace_s)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.call_later, grace_s, self._close_all)

    def _close_all(self) -> None:
        self._closed = True
        self._fail_all(shutdown_error)

    def _fail_all(self, error_for: Callable[[str], ErrorEvent]) -> None:
        for subs in self._subs.values():
            for sub in subs:
                sub.fail(error_for(sub.job_id))

    async def _run(self, group: int) -> None:
        while not self._stopping:
            try:
                await retry(
                    lambda: self._read_when_subscribed(group),
                    on=(RedisError, OSError),
                    what="relay read",
                    backoff=READ_BACKOFF,
                    give_up_after_s=FOREVER,  # waits end after outage_grace_s (_on_lost)
                    on_error=self._on_lost,
                )
                if not self.healthy:
                    self._on_reconnect()
            except Exception:  # the relay must outlive any surprise, or every stream hangs
                log.exception("relay read failed")
                await asyncio.sleep(1.0)

    async def _read_when_subscribed(self, group: int) -> None:
        """Wait until one of the group's reads returns (none runs while nobody, or only
        paused readers, are subscribed) and deliver its entries."""
        if self._stopping:  # a cancelled read can surface as a ConnectionError: retry ends
            return
        reads = self._reads[group]
        try:
            finished = await self._next_finished(group, reads)
            for task in finished:
                del reads[task]
            for task in finished:
                self._deliver(task.result())  # a failed read raises here: retried
        except BaseException:
            for task in reads:
                task.cancel()
            reads.clear()
            raise

    async def _next_finished(
        self, group: int, reads: dict[asyncio.Task[list], set[str]]
    ) -> set[asyncio.Task[list]]:
        """Start a read of the streams no read in flight covers; on a wake-up (a new or a
        resumed subscriber) look again, until a read returns."""
        wake = self._wakes[group]  # also set by each read as it ends (_start_read)
        while True:
            wake.clear()
            self._start_read(group, reads)
            finished = {task for task in reads if task.done()}
            if finished:
                return finished
            await wake.wait()

    def _start_read(self, group: int, reads: dict[asyncio.Task[list], set[str]]) -> None:
        if len(reads) >= MAX_READS:
            return
        covered = set().union(*reads.values())
        positions = {s: p for s, p in self._positions(group).items() if s not in covered}
        if positions:
            task = asyncio.ensure_future(self.shards.read(group, positions, self.block_ms))
            task.add_done_callback(lambda _: self._wakes[group].set())
            reads[task] = set(positions)

    def _on_lost(self, exc: BaseException) -> None:
        now = time.monotonic()
        if self.healthy:
            log.warning("relay lost Redis", extra={"error": repr(exc)})
            self.healthy, self._lost_since = False, now
        elif self._lost_since is not None and now - self._lost_since > self.outage_grace_s:
            log.error("Redis unreachable for %.0f s; ending open streams", now - self._lost_since)
            self._lost_since = None  # once per outage
            self._fail_all(
                lambda job_id: ErrorEvent(
                    status=503,
                    error_type="service_unavailable",
                    code="redis_unavailable",
                    message=f"Redis is unreachable; job {job_id} may still finish: fetch it later "
                    f"with GET /v1/jobs/{job_id}",
                )
            )

    def _on_reconnect(self) -> None:
        log.info("relay reconnected to Redis")
        self.healthy, self._lost_since = True, None
        task = asyncio.create_task(self._verify_jobs(), name="relay-verify")
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    async def _verify_jobs(self) -> None:
        """After an outage: end the waits of jobs whose records Redis no longer has (it
        restarted without persistence). Running jobs' records are put back by their
        workers' heartbeats, so this waits a little first."""
        await asyncio.sleep(self.verify_delay_s)
        subs = {sub.job_id: sub_set for sub_set in self._subs.values() for sub in sub_set}
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for job_id in subs:
                    pipe.exists(self.keys.job(job_id))
                found = await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning("could not verify jobs after reconnecting", extra={"error": repr(exc)})
            return  # the next reconnect checks again
        for (job_id, sub_set), exists in zip(subs.items(), found, strict=True):
            if not exists:
                log.warning("job lost by Redis", extra={"job_id": job_id})
                for sub in list(sub_set):
                    sub.fail(job_lost_error(job_id))

    def _deliver(self, replies: list | None) -> None:
        for stream_name, entries in replies or []:
            stream = _text(stream_name)
            for entry_id, fields in entries:
                self._dispatch(stream, _text(entry_id), fields)

    def _dispatch(self, stream: str, entry_id: str, fields: dict) -> None:
        raw = fields.get(b"data", fields.get("data"))
        event: StreamEvent | None = None
        try:
            event = decode_event(raw)
        except (ValueError, TypeError) as exc:
            log.error("undecodable stream entry", extra={"stream": stream, "error": repr(exc)})
        for sub in list(self._subs.get(stream, ())):
            if not sub.is_paused and not sub._offer(entry_id, event):
                log.info("client behind; pausing its stream", extra={"job_id": sub.job_id})


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def shutdown_error(job_id: str) -> ErrorEvent:
    return ErrorEvent(
        status=503,
        error_type="service_unavailable",
        code="server_shutting_down",
        message=f"The API server is shutting down; job {job_id} continues: fetch its result "
        f"with GET /v1/jobs/{job_id}",
    )


def job_lost_error(job_id: str) -> ErrorEvent:
    return ErrorEvent(
        status=503,
        error_type="service_unavailable",
        code="job_lost",
        message=f"Job {job_id} was lost when Redis restarted without persistence; submit it again",
    )

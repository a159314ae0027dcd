"""One multiplexed Redis Streams reader per API process.

A single background task runs `XREAD BLOCK` over every stream that has subscribers and fans
the entries out to per-subscriber asyncio queues. The block is capped (`block_ms`) so a new
subscriber's stream joins the read within that time; entries already in a stream are replayed
from the subscriber's last id, so subscribing after enqueueing loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.contracts import StreamEvent, decode_event
from shared.keys import Keys

log = logging.getLogger(__name__)


def parse_entry_id(entry_id: str) -> tuple[int, int]:
    """'1700000000000-3' -> (1700000000000, 3); ValueError if malformed."""
    ms, _, seq = entry_id.partition("-")
    if not ms.isdigit() or (seq and not seq.isdigit()):
        raise ValueError(f"not a stream entry id: {entry_id!r}")
    return int(ms), int(seq or 0)


@dataclass(eq=False)
class Subscription:
    """One reader of one job's events, from after `last_id`."""

    job_id: str
    stream: str
    last_id: str = "0-0"
    queue: asyncio.Queue[tuple[str, StreamEvent]] = field(default_factory=asyncio.Queue)

    async def next(self, timeout: float | None) -> tuple[str, StreamEvent]:
        """The next (entry id, event); raises TimeoutError."""
        return await asyncio.wait_for(self.queue.get(), timeout)

    def _offer(self, entry_id: str, event: StreamEvent | None) -> None:
        """Deliver an entry past our position; None (undecodable) only moves the position."""
        if parse_entry_id(entry_id) > parse_entry_id(self.last_id):
            self.last_id = entry_id
            if event is not None:
                self.queue.put_nowait((entry_id, event))


class Relay:
    """The process's stream reader; `subscribe`/`unsubscribe` are cheap and synchronous."""

    def __init__(self, redis: Redis, keys: Keys, block_ms: int = 50) -> None:
        self.redis = redis
        self.keys = keys
        self.block_ms = block_ms
        self.healthy = True
        self._subs: dict[str, set[Subscription]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

    def subscribe(self, job_id: str, last_id: str = "0-0") -> Subscription:
        parse_entry_id(last_id)
        sub = Subscription(job_id, self.keys.stream(job_id), last_id)
        self._subs.setdefault(sub.stream, set()).add(sub)
        self._wake.set()
        self.start()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.stream)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.stream]

    @property
    def num_streams(self) -> int:
        return len(self._subs)

    def start(self) -> None:
        if self._task is None and not self._stopping:
            self._task = asyncio.create_task(self._run(), name="stream-relay")

    async def stop(self) -> None:
        self._stopping = True  # redis-py may turn a cancelled read into a ConnectionError
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        while not self._stopping:
            if not self._subs:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._read_once()
                self.healthy, backoff = True, 0.05
            except RedisError as exc:
                if self.healthy:
                    log.warning("relay lost Redis", extra={"error": repr(exc)})
                self.healthy = False
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _read_once(self) -> None:
        positions = {
            stream: min((s.last_id for s in subs), key=parse_entry_id)
            for stream, subs in self._subs.items()
        }
        replies = await self.redis.xread(positions, block=self.block_ms)
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
            sub._offer(entry_id, event)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

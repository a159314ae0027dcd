"""Lean relay clients that speak RESP over plain sockets, to load Redis rather than Python.

The real publisher and relay spend ~10x more CPU per token than Redis does (pydantic events,
redis-py packing, one asyncio wake per token), so on a small machine they saturate first
(docs/benchmarks.md, "The token relay through Redis"). These clients send Redis exactly what
the real ones send, at a fraction of the client cost:

- publisher: per step one `XADD {stream} MAXLEN ~ N * data <event JSON>` for each of its
  streams, all pipelined per Redis; steps that come due while Redis lags are coalesced into one
  pipeline, as `worker.publisher.Publisher` does. Each event's text is its scheduled time, so
  latency includes any backlog in the publisher.
- reader: one connection per read group (a Redis, a shard, or a cluster slot group) with one
  `XREAD BLOCK` over all of the group's streams outstanding, as `api.jobs.relay.Relay` does;
  replies are parsed by hiredis and not decoded further, except a latency sample.
"""

from __future__ import annotations

import json
import resource
import selectors
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import hiredis

from shared.contracts import DeltaEvent, encode_event

STAMP = "X" * 17  # f"{time.time():.6f}" is 17 characters until 2286
MAX_COALESCED_STEPS = 50  # one pipeline carries at most this many steps' tokens
MAX_BACKLOG_S = 2.0  # steps further behind than this are dropped (and counted), not queued
SAMPLE_EVERY = 7  # latency sample: every 7th stream in a reply


@dataclass(frozen=True)
class Plan:
    """Where each stream lives: its read group, and each group's Redis (host, port)."""

    stream_keys: list[str]
    groups: list[int]  # per stream
    group_targets: list[tuple[str, int]]  # per group


@dataclass(frozen=True)
class Window:
    start_at: float
    measure_at: float
    end_at: float


def job_id(index: int) -> str:
    return f"job-relay-{index:06d}"


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _bulk(data: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(data), data)


def _xadd_prefix(key: str, maxlen: int) -> bytes:
    parts = [b"XADD", key.encode(), b"MAXLEN", b"~", str(maxlen).encode(), b"*", b"data"]
    return b"*8\r\n" + b"".join(_bulk(p) for p in parts)


def _event_template() -> tuple[bytes, bytes]:
    text = encode_event(DeltaEvent(text=STAMP, token_ids=[7], pos=1))
    head, tail = text.split(STAMP)
    return head.encode(), tail.encode()


def _connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _await_replies(sock: socket.socket, reader: hiredis.Reader, count: int) -> int:
    """Read `count` replies; how many were errors."""
    errors = 0
    while count:
        reply = reader.gets()
        if reply is False:
            chunk = sock.recv(1 << 20)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            reader.feed(chunk)
            continue
        errors += isinstance(reply, hiredis.ReplyError)
        count -= 1
    return errors


class RawPublisher:
    def __init__(self, plan: Plan, indexes: list[int], rate: float, maxlen: int) -> None:
        targets = sorted({plan.group_targets[plan.groups[i]] for i in indexes})
        self.socks = {t: _connect(t) for t in targets}
        self.readers = {t: hiredis.Reader() for t in targets}
        self.prefixes: dict[tuple[str, int], list[bytes]] = {t: [] for t in targets}
        for i in indexes:
            target = plan.group_targets[plan.groups[i]]
            self.prefixes[target].append(_xadd_prefix(plan.stream_keys[i], maxlen))
        self.head, self.tail = _event_template()
        self.period = 1.0 / rate
        self.num_streams = len(indexes)
        self.counts = {"published": 0, "dropped": 0, "errors": 0, "pipelines": 0}

    def run(self, window: Window) -> dict:
        next_step, cpu_at_measure = window.start_at, None
        while (now := time.time()) < window.end_at:
            if cpu_at_measure is None and now >= window.measure_at:
                cpu_at_measure = cpu_s()
            if next_step > now:
                time.sleep(min(next_step - now, window.end_at - now))
                continue
            if now - next_step > MAX_BACKLOG_S:  # too far behind: drop, like a stalled engine
                missed = int((now - next_step - MAX_BACKLOG_S) / self.period) + 1
                self._count_in(window, next_step, missed, "dropped")
                next_step += missed * self.period
            due = min(int((now - next_step) / self.period) + 1, MAX_COALESCED_STEPS)
            stamps = [next_step + k * self.period for k in range(due)]
            self._send(stamps)
            for stamp in stamps:
                self._count_in(window, stamp, 1, "published")
            next_step += due * self.period
        return {**self.counts, "cpu_s": cpu_s() - (cpu_at_measure or cpu_s())}

    def _count_in(self, window: Window, stamp: float, steps: int, what: str) -> None:
        if window.measure_at <= stamp < window.end_at:
            self.counts[what] += steps * self.num_streams

    def _send(self, stamps: list[float]) -> None:
        payloads = [_bulk(self.head + f"{s:.6f}".encode() + self.tail) for s in stamps]
        for target, sock in self.socks.items():  # every Redis gets its pipeline first ...
            prefixes = self.prefixes[target]
            sock.sendall(b"".join(p + payload for payload in payloads for p in prefixes))
        for target, sock in self.socks.items():  # ... then their replies are read
            count = len(stamps) * len(self.prefixes[target])
            self.counts["errors"] += _await_replies(sock, self.readers[target], count)
        self.counts["pipelines"] += len(self.socks)


class _Group:
    """One read group's connection, positions and outstanding XREAD."""

    def __init__(self, address: tuple[str, int], keys: list[str], block_ms: int) -> None:
        self.sock = _connect(address)
        self.reader = hiredis.Reader()
        self.positions = {key.encode(): b"0-0" for key in keys}
        self.block = str(block_ms).encode()

    def send_read(self) -> None:
        streams = [*self.positions, *self.positions.values()]
        args = [b"XREAD", b"BLOCK", self.block, b"STREAMS", *streams]
        self.sock.sendall(b"*%d\r\n" % len(args) + b"".join(_bulk(a) for a in args))


class RawReader:
    def __init__(self, plan: Plan, indexes: list[int], block_ms: int = 50) -> None:
        by_group: dict[int, list[str]] = {}
        for i in indexes:
            by_group.setdefault(plan.groups[i], []).append(plan.stream_keys[i])
        self.groups = [_Group(plan.group_targets[g], ks, block_ms) for g, ks in by_group.items()]
        self.counts = {"delivered": 0, "reads": 0, "entries_read": 0}
        self.latencies: list[float] = []

    def run(self, window: Window) -> dict:
        selector = selectors.DefaultSelector()
        for group in self.groups:
            selector.register(group.sock, selectors.EVENT_READ, group)
        time.sleep(max(0.0, window.start_at - time.time()))
        for group in self.groups:
            group.send_read()
        cpu_at_measure = None
        while (now := time.time()) < window.end_at:
            if cpu_at_measure is None and now >= window.measure_at:
                cpu_at_measure = cpu_s()
            for key, _ in selector.select(timeout=min(0.1, window.end_at - now)):
                self._on_readable(key.data, window)
        return {
            **self.counts,
            "latencies": self.latencies,
            "cpu_s": cpu_s() - (cpu_at_measure or cpu_s()),
        }

    def _on_readable(self, group: _Group, window: Window) -> None:
        chunk = group.sock.recv(1 << 22)
        if not chunk:
            raise ConnectionError("Redis closed the connection")
        group.reader.feed(chunk)
        reply = group.reader.gets()
        if reply is False:
            return
        if isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"XREAD failed: {reply}")
        now = time.time()
        for key, entries in reply or []:
            group.positions[key] = entries[-1][0]
        group.send_read()  # the next read goes out before this one is counted
        self.counts["reads"] += 1
        num_entries = sum(len(entries) for _, entries in reply or [])
        self.counts["entries_read"] += num_entries
        if window.measure_at <= now < window.end_at:
            self.counts["delivered"] += num_entries
            for _, entries in (reply or [])[::SAMPLE_EVERY]:
                stamp = float(json.loads(entries[-1][1][1])["text"])
                self.latencies.append(now - stamp)


def raw_process_main(
    kind: str, plan: Plan, indexes: list[int], rate: float, maxlen: int, pipe: Connection
) -> None:
    """One raw publisher or reader process: connects, says so, then waits for the start."""
    client = (
        RawPublisher(plan, indexes, rate, maxlen) if kind == "publish" else RawReader(plan, indexes)
    )
    pipe.send("ready")
    pipe.send(client.run(pipe.recv()))

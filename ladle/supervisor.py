"""The children of `ladle up`, kept running: a child that exits unexpectedly is restarted
after a backoff (1 s doubling to 30 s by default), unless it crashed `max_crashes` times
within `window_s`: then it is left stopped, the log and `/ready` say so, and the others go on.

`Supervisor.check()` is called from the launcher's loop; it never blocks. The children run in
their own sessions, so only the supervisor decides how they stop.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import redis

from shared.config import Settings
from shared.contracts import ChildState, ChildStatus, SupervisorRecord
from shared.errors import EXIT_CONFIG_ERROR
from shared.keys import Keys
from shared.redis_url import sync_client

logger = logging.getLogger("ladle.supervisor")


@dataclass(frozen=True)
class RestartPolicy:
    """When to restart a child that exited on its own, and when to stop trying."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0  # also: a child up this long restarts after `backoff_s` again
    max_crashes: int = 5
    window_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: Settings) -> RestartPolicy:
        return cls(
            backoff_s=settings.restart_backoff_s,
            backoff_max_s=settings.restart_backoff_max_s,
            max_crashes=settings.crash_loop_max_crashes,
            window_s=settings.crash_loop_window_s,
        )

    def next_delay(self, previous_s: float, uptime_s: float) -> float:
        """The wait before the next start: doubling while the child keeps crashing quickly."""
        if previous_s <= 0 or uptime_s >= self.backoff_max_s:
            return self.backoff_s
        return min(previous_s * 2, self.backoff_max_s)


@dataclass
class ChildSpec:
    """One child process to run: a name for logs, its argv and its full environment."""

    name: str
    argv: list[str]
    env: dict[str, str]


@dataclass
class Child:
    """A supervised child: its current process (None while it waits or gave up) and history."""

    spec: ChildSpec
    proc: subprocess.Popen | None = field(default=None, repr=False)
    state: ChildState = "stopped"
    started_at: float = 0.0
    restarts: int = 0
    crashes: deque[float] = field(default_factory=deque)
    delay_s: float = 0.0
    restart_at: float = 0.0
    last_exit: str | None = None
    message: str | None = None
    refused: bool = False  # exited with EXIT_CONFIG_ERROR: never restarted

    @property
    def name(self) -> str:
        return self.spec.name

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> ChildStatus:
        return ChildStatus(
            name=self.name,
            state=self.state,
            pid=self.proc.pid if self.is_alive() and self.proc else None,
            restarts=self.restarts,
            recent_crashes=len(self.crashes),
            last_exit=self.last_exit,
            message=self.message,
        )


def describe_exit(code: int | None) -> str:
    """`code 3`, or `signal SIGTERM` for a negative Popen return code."""
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"code {code}"


class Supervisor:
    """Starts the children, restarts those that exit on their own, stops them all."""

    def __init__(
        self,
        specs: Sequence[ChildSpec],
        policy: RestartPolicy | None = None,
        on_restart: Callable[[str], None] = lambda name: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.children = [Child(spec) for spec in specs]
        self.policy = policy or RestartPolicy()
        self._on_restart = on_restart
        self._clock = clock

    def start(self) -> None:
        for child in self.children:
            self._spawn(child)

    def check(self) -> None:
        """Notice exits (schedule a restart, or give up) and start what is due."""
        now = self._clock()
        for child in self.children:
            if child.state == "running" and not child.is_alive():
                self._on_exit(child, now)
            elif child.state == "restarting" and now >= child.restart_at:
                self._spawn(child)
                child.restarts += 1
                self._on_restart(child.name)

    def _spawn(self, child: Child) -> None:
        spec = child.spec
        child.proc = subprocess.Popen(spec.argv, env=spec.env, start_new_session=True)
        child.state, child.started_at = "running", self._clock()
        logger.info("started %s (pid %d): %s", spec.name, child.proc.pid, " ".join(spec.argv[1:]))

    def _on_exit(self, child: Child, now: float) -> None:
        assert child.proc is not None
        child.last_exit = describe_exit(child.proc.returncode)
        if child.proc.returncode == EXIT_CONFIG_ERROR:  # restarting cannot help
            child.state, child.proc, child.refused = "given_up", None, True
            child.message = (
                f"{child.name} refused its configuration (exit {EXIT_CONFIG_ERROR}); "
                "its last log line says why"
            )
            logger.error("%s", child.message)
            return
        uptime = now - child.started_at
        child.crashes.append(now)
        while child.crashes and child.crashes[0] <= now - self.policy.window_s:
            child.crashes.popleft()
        window, count = self.policy.window_s, len(child.crashes)
        if count >= self.policy.max_crashes:
            child.state, child.proc = "given_up", None
            child.message = (
                f"{child.name} exited {count} times within {window:.0f} s (last: "
                f"{child.last_exit}); no longer restarted. Restart `ladle up` once it is fixed."
            )
            logger.error("%s; the other processes keep serving", child.message)
            return
        child.delay_s = self.policy.next_delay(child.delay_s, uptime)
        child.state, child.restart_at = "restarting", now + child.delay_s
        child.message = f"restarting after {child.last_exit}"
        logger.error(
            "%s exited unexpectedly (%s) after %.1f s; restarting it in %.0f s "
            "(%d of %d crashes allowed within %.0f s)",
            child.name,
            child.last_exit,
            uptime,
            child.delay_s,
            count,
            self.policy.max_crashes - 1,
            window,
        )

    def refused(self) -> list[Child]:
        """Children that exited with a configuration error (never restarted)."""
        return [child for child in self.children if child.refused]

    def all_given_up(self) -> bool:
        return all(child.state == "given_up" for child in self.children)

    def any_alive(self) -> bool:
        return any(child.is_alive() for child in self.children)

    def statuses(self) -> list[ChildStatus]:
        return [child.status() for child in self.children]

    def stop(self, timeout_s: float, force: Callable[[], bool] = lambda: False) -> None:
        """SIGTERM every child, wait up to `timeout_s` (or until `force()`), then SIGKILL."""
        for child in self.children:
            if child.state == "restarting":
                child.state = "stopped"  # never started again
        alive = [c for c in self.children if c.is_alive()]
        for child in alive:
            _send(child, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(c.is_alive() for c in alive) and time.monotonic() < deadline and not force():
            time.sleep(0.1)
        for child in alive:
            if child.is_alive():
                logger.warning("%s did not stop in time; killing it", child.name)
                _send(child, signal.SIGKILL)
        for child in alive:
            assert child.proc is not None
            child.proc.wait()
            child.state = "stopped"
            logger.info("%s exited (%s)", child.name, describe_exit(child.proc.returncode))


def _send(child: Child, sig: signal.Signals) -> None:
    try:
        if child.proc is not None:
            child.proc.send_signal(sig)
    except ProcessLookupError:
        pass


class StatusPublisher:
    """Puts the supervisor's view of its children in Redis (for `/ready`), at most once per
    `interval_s`, with a TTL so a dead supervisor's record disappears. A Redis outage only
    costs a skipped update: the supervisor must never wait on Redis."""

    def __init__(self, redis_url: str, keys: Keys, interval_s: float = 1.0) -> None:
        self.client = sync_client(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.keys = keys
        self.interval_s = interval_s
        self.supervisor_id = f"{socket.gethostname()}-{os.getpid()}"
        self._next = 0.0

    def publish(self, statuses: list[ChildStatus], force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next and not force:
            return
        self._next = now + self.interval_s
        record = SupervisorRecord(
            supervisor_id=self.supervisor_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            children=statuses,
        )
        ttl_ms = int(self.interval_s * 5000)
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.set(self.keys.supervisor(self.supervisor_id), record.model_dump_json(), px=ttl_ms)
            pipe.zadd(self.keys.supervisors, {self.supervisor_id: record.updated_at})
            pipe.execute()
        except (redis.RedisError, OSError) as exc:
            logger.debug("could not publish the supervisor status: %s", exc)

    def remove(self) -> None:
        try:
            self.client.delete(self.keys.supervisor(self.supervisor_id))
            self.client.zrem(self.keys.supervisors, self.supervisor_id)
        except (redis.RedisError, OSError):
            pass
        self.client.close()

"""`ladle up` as a subprocess, for the chaos run and the supervisor's integration test.

Its children's pids come from the supervisor's own record in Redis (what `/ready` shows), so
a caller can signal the API or a given worker exactly as an operator would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.contracts import ChildStatus, SupervisorRecord
from shared.keys import Keys

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class UpProcess:
    """One `python -m ladle up` run with its own key prefix, port and log file."""

    env: dict[str, str]
    port: int
    num_workers: int
    log_path: Path
    proc: subprocess.Popen | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def redis_url(self) -> str:
        return self.env["LLM_REDIS_URL"]

    @property
    def keys(self) -> Keys:
        return Keys(self.env["LLM_KEY_PREFIX"])

    def start(self) -> None:
        argv = [sys.executable, "-m", "ladle", "up", "--workers", str(self.num_workers)]
        argv += ["--port", str(self.port), "--no-start-redis", *self.extra_args]
        log = open(self.log_path, "ab")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=log)

    def children(self) -> dict[str, ChildStatus]:
        """name -> status, from the supervisor's record ({} while Redis is away)."""
        try:
            client = redis.Redis.from_url(self.redis_url, socket_timeout=2)
            ids = client.zrange(self.keys.supervisors, 0, -1)
            raws = client.mget([self.keys.supervisor(i.decode()) for i in ids]) if ids else []
        except (redis.RedisError, OSError):
            return {}
        found: dict[str, ChildStatus] = {}
        for raw in filter(None, raws):
            record = SupervisorRecord.model_validate_json(raw)
            found.update({child.name: child for child in record.children})
        return found

    def pid(self, name: str) -> int | None:
        child = self.children().get(name)
        return child.pid if child is not None and child.state == "running" else None

    def live_workers(self, http: httpx.Client) -> list[dict]:
        try:
            response = http.get(f"{self.base_url}/v1/workers")
        except httpx.HTTPError:
            return []
        return response.json()["data"] if response.status_code == 200 else []

    def wait_ready(self, http: httpx.Client, num_workers: int, timeout: float = 180.0) -> None:
        """Until `/ready` is 200 and `num_workers` workers heartbeat."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"ladle up exited ({self.proc.returncode}); see {self.log_path}")
            try:
                ready = http.get(f"{self.base_url}/ready").status_code == 200
            except httpx.HTTPError:
                ready = False
            if ready and len(self.live_workers(http)) >= num_workers:
                return
            time.sleep(0.2)
        raise TimeoutError(f"ladle up not ready in {timeout} s; see {self.log_path}")

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (a graceful stop of everything); SIGKILL the group if it hangs."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for child in self.children().values():  # they run in sessions of their own
                if child.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child.pid, signal.SIGKILL)
            self.proc.kill()
            return self.proc.wait()


def kill_child(up: UpProcess, name: str, sig: int = signal.SIGKILL) -> int | None:
    """Signal one child of `ladle up` by name; its pid, or None if it is not running."""
    pid = up.pid(name)
    if pid is not None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return None
    return pid

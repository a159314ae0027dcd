"""Real processes for integration tests: the API and workers on the real Redis.

Each service gets its own key prefix in db 15 (LLM_TEST_REDIS_URL overrides) and removes
its keys, and arq's keys for its jobs, when it stops.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from shared.keys import Keys
from shared.redis_url import sync_client

TEST_REDIS_URL = os.environ.get("LLM_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
ROOT = Path(__file__).resolve().parents[2]


def wait_until(condition: Callable[[], object], timeout_s: float, what: str) -> None:
    """Poll `condition` until it is true; AssertionError naming `what` after `timeout_s`.

    The deadline is generous on purpose: it bounds a hung test, it does not guess speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_available(url: str = TEST_REDIS_URL) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=1).ping())
    except (redis.RedisError, OSError):
        return False


@dataclass
class Service:
    """An API process and N worker processes sharing one key prefix."""

    model_dir: Path
    log_dir: Path
    env: dict[str, str]
    port: int
    prefix: str
    redis_url: str = TEST_REDIS_URL
    api: subprocess.Popen | None = None
    workers: list[subprocess.Popen | None] = field(default_factory=list)
    extra_apis: list[subprocess.Popen] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs: object) -> httpx.Client:
        """A client of the API; with LLM_API_KEYS set, authenticated with the first key."""
        keys = [k for k in self.env.get("LLM_API_KEYS", "").split(",") if k]
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        return httpx.Client(base_url=self.base_url, timeout=60, headers=headers, **kwargs)

    def start_extra_api(self) -> str:
        """Another API process on the same Redis and prefix; its base URL."""
        port = spare_port()
        self.extra_apis.append(self._spawn("api", f"api-{port}", {"LLM_PORT": str(port)}))
        return f"http://127.0.0.1:{port}"

    def _spawn(self, module: str, name: str, extra: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (owned by the process)
        return subprocess.Popen(
            [sys.executable, "-m", module],
            cwd=ROOT,
            env={**self.env, **extra},
            stdout=log,
            stderr=log,
        )

    def start_api(self) -> None:
        self.api = self._spawn("api", "api", {})

    def start_worker(
        self, module: str = "worker", env: dict[str, str] | None = None, **settings: object
    ) -> int:
        """One more worker; `settings` (LLM_* without the prefix) on top of the service's.
        `module` and `env`: a test's wrapper of `python -m worker` and what it reads."""
        index = len(self.workers)
        extra = {f"LLM_{key.upper()}": str(value) for key, value in settings.items()}
        extra.update(env or {})
        extra["LLM_WORKER_ID"] = f"{self.prefix}-w{index}"
        self.workers.append(self._spawn(module, f"worker{index}", extra))
        return index

    def worker_id(self, index: int) -> str:
        return f"{self.prefix}-w{index}"

    def signal_worker(self, index: int, sig: int) -> None:
        proc = self.workers[index]
        assert proc is not None
        proc.send_signal(sig)

    def wait_ready(self, num_workers: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while time.monotonic() < deadline:
                self._check_alive()
                try:
                    if client.get("/ready").status_code == 200 and (
                        len(self.live_workers(client)) >= num_workers
                    ):
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"service not ready in {timeout} s; logs in {self.log_dir}")

    def live_workers(self, client: httpx.Client) -> list[dict]:
        response = client.get("/v1/workers")
        return response.json()["data"] if response.status_code == 200 else []

    def wait_kv_free(self, client: httpx.Client, timeout: float = 1.0) -> float:
        """Seconds until every live worker reports zero KV blocks used and nothing running."""
        started = time.monotonic()
        while True:
            workers = self.live_workers(client)
            if workers and all(w["kv_blocks_used"] == 0 and w["running"] == 0 for w in workers):
                return time.monotonic() - started
            if time.monotonic() - started > timeout:
                raise AssertionError(f"KV blocks still used after {timeout} s: {workers}")
            time.sleep(0.05)

    def is_alive(self) -> bool:
        """Every process started and not killed by the test is still running."""
        return all(p.poll() is None for p in [self.api, *self.workers] if p is not None)

    def _check_alive(self) -> None:
        for proc in [self.api, *self.workers]:
            if proc is not None and proc.poll() is not None and proc.returncode not in (0,):
                raise RuntimeError(
                    f"a service process exited ({proc.returncode}); logs in {self.log_dir}"
                )

    def stop(self) -> None:
        procs = [*self.workers, self.api, *self.extra_apis]
        for proc in procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            if proc is None:
                continue
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            cleanup_keys(self.prefix, self.redis_url)
        except (redis.RedisError, OSError):
            pass  # a test's own Redis, already stopped


def cleanup_keys(prefix: str, url: str = TEST_REDIS_URL) -> None:
    client = sync_client(url, socket_timeout=5)
    job_ids = [Keys.job_id_of(key) for key in client.scan_iter(f"{prefix}:job:*")]
    for job_id in job_ids:
        client.delete(
            *(f"arq:{kind}:{job_id}" for kind in ("job", "result", "retry", "in-progress"))
        )
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)


def start_service(
    model_dir: Path,
    log_dir: Path,
    num_workers: int = 1,
    redis_url: str = TEST_REDIS_URL,
    ready_timeout_s: float = 90.0,
    **settings: object,
) -> Service:
    prefix = f"ladletest-{uuid.uuid4().hex[:8]}"
    port = spare_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LLM_REDIS_URL": redis_url,
        "LLM_KEY_PREFIX": prefix,
        "LLM_MODEL_NAME": str(model_dir),
        "LLM_PORT": str(port),
        "LLM_DTYPE": "float32",
        "LLM_DEVICE": "cpu",
        "LLM_KV_CACHE_SIZE_MB": "8",
        "LLM_NUM_THREADS": "1",
        "LLM_COMPILE": "off",  # exact float32 tokens, and a worker that starts in seconds
        "LLM_LINEAR_KERNEL": "plain",
        # plain kernels are not batch invariant: the mode is tested in test_determinism_service
        "LLM_DETERMINISTIC": "false",
        "LLM_WORKER_METRICS_PORT": "0",
        "LLM_HEARTBEAT_INTERVAL_S": "0.2",
        "LLM_WORKER_TTL_S": "2",
        "LLM_SHUTDOWN_TIMEOUT_S": "5",
    }
    env.update({f"LLM_{key.upper()}": str(value) for key, value in settings.items()})
    log_dir.mkdir(parents=True, exist_ok=True)
    service = Service(model_dir, log_dir, env, port, prefix, redis_url)
    service.start_api()
    for _ in range(num_workers):
        service.start_worker()
    try:
        service.wait_ready(num_workers, ready_timeout_s)
    except BaseException:
        service.stop()
        raise
    return service


REDIS_SERVER = "/usr/bin/redis-server"


@dataclass
class RedisServer:
    """A private `redis-server` on a spare port, stopped and restarted by a test.

    Persistence is off unless `aof`: then `appendonly yes`, `appendfsync everysec` in `dir`.
    """

    dir: Path
    aof: bool = False
    port: int = field(default_factory=spare_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--daemonize",
            "no",
            "--appendonly",
            "yes" if self.aof else "no",
            "--appendfsync",
            "everysec",
        ]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 (owned by the process)
        self.proc = subprocess.Popen(args, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while not redis_available(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {self.dir}/redis.log")
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM: a clean shutdown (the AOF is flushed; nothing else is saved)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
        self.proc = None

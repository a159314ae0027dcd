"""`ladle up`: a Redis, one API process and N workers as children, supervised until a signal.

The children are `python -m api` and `python -m worker`, started in their own sessions so the
launcher alone decides how they stop: on SIGINT/SIGTERM it sends each SIGTERM, waits for the
workers to drain, then kills what is left (a second signal kills at once). A child that exits
on its own is restarted with backoff (`ladle/supervisor.py`); the others keep serving.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import start_http_server

from ladle.broker import BrokerError, find_or_start_redis, safe_url
from ladle.supervisor import (
    ChildSpec,
    RestartPolicy,
    StatusPublisher,
    Supervisor,
    describe_exit,
)
from shared.config import Settings, allocator_env
from shared.errors import EXIT_CONFIG_ERROR
from shared.keys import Keys
from shared.logging import setup_logging
from shared.metrics import SupervisorMetrics

logger = logging.getLogger("ladle.launcher")

# Time on top of LLM_SHUTDOWN_TIMEOUT_S: a worker drains for that long, then hands jobs back.
SHUTDOWN_MARGIN_S = 15.0
# `/ready` is asked this often until it first answers: the start-up time is measured to it
READY_POLL_S = 0.1


@dataclass(frozen=True)
class WorkerGroup:
    """`--worker [NAME=]MODEL[:COUNT]`: COUNT workers loading MODEL, served as NAME (default:
    the model's file or directory name)."""

    model: str
    count: int = 1
    served_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> WorkerGroup:
        served_name, _, rest = text.rpartition("=") if "=" in text else (None, "", text)
        model, count = rest, 1
        head, _, tail = rest.rpartition(":")
        if head and tail.isdigit():
            model, count = head, int(tail)
        if not model or count < 1 or served_name == "":
            raise ValueError(f"expected [NAME=]MODEL[:COUNT] with COUNT >= 1, got {text!r}")
        return cls(model, count, served_name)


@dataclass
class UpOptions:
    """What `ladle up` was asked for; None means "from the LLM_* settings"."""

    num_workers: int = 1
    worker_groups: list[WorkerGroup] = field(default_factory=list)
    host: str | None = None
    port: int | None = None
    model: str | None = None
    redis_url: str | None = None
    start_redis: bool = True
    ready_timeout_s: float = 600.0
    shutdown_timeout_s: float | None = None


def settings_for(options: UpOptions) -> Settings:
    """The settings the children will see: LLM_* variables and .env, then the flags. With
    `--worker` groups and no `--model`, the API's default model is the first group's."""
    first = options.worker_groups[0] if options.worker_groups else None
    overrides = {
        "host": options.host,
        "port": options.port,
        "model_name": options.model or (first.model if first else None),
        "served_model_name": first.served_name if first and not options.model else None,
        "redis_url": options.redis_url,
    }
    return Settings(**{k: v for k, v in overrides.items() if v is not None})


def child_specs(
    settings: Settings,
    num_workers: int,
    base_env: dict[str, str],
    worker_id_base: str | None = None,
    groups: list[WorkerGroup] | None = None,
) -> list[ChildSpec]:
    """The API and the workers (`num_workers` of the default model, or the `groups`), each
    with distinct worker id and metrics port."""
    env = dict(base_env)
    env.update(
        {
            "LLM_REDIS_URL": settings.redis_url,
            "LLM_HOST": settings.host,
            "LLM_PORT": str(settings.port),
            "LLM_MODEL_NAME": settings.model_name,
        }
    )
    if settings.served_model_name:
        env["LLM_SERVED_MODEL_NAME"] = settings.served_model_name
    specs = [ChildSpec("api", [sys.executable, "-m", "api"], env)]
    id_base = worker_id_base or settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    models = _worker_models(settings, num_workers, groups)
    threads = _threads_per_worker(len(models), base_env)
    for i, group in enumerate(models):
        worker_env = dict(env)
        if groups:  # each group's own model and name
            worker_env["LLM_MODEL_NAME"] = group.model
            worker_env.pop("LLM_SERVED_MODEL_NAME", None)
            if group.served_name:
                worker_env["LLM_SERVED_MODEL_NAME"] = group.served_name
        worker_env["LLM_WORKER_ID"] = f"{id_base}-{i}"
        port = settings.worker_metrics_port
        worker_env["LLM_WORKER_METRICS_PORT"] = str(port + i if port else 0)
        if threads:
            worker_env["LLM_NUM_THREADS"] = str(threads)
        worker_env = allocator_env(worker_env, settings.malloc)  # no re-exec at its start
        specs.append(ChildSpec(f"worker-{i}", [sys.executable, "-m", "worker"], worker_env))
    return specs


def _worker_models(
    settings: Settings, num_workers: int, groups: list[WorkerGroup] | None
) -> list[WorkerGroup]:
    """One entry per worker process."""
    if not groups:
        return [WorkerGroup(settings.model_name)] * num_workers
    return [group for group in groups for _ in range(group.count)]


def _threads_per_worker(num_workers: int, env: dict[str, str]) -> int | None:
    """Share the CPU cores among several workers unless LLM_NUM_THREADS says otherwise."""
    if num_workers < 2 or env.get("LLM_NUM_THREADS"):
        return None
    return max(1, (os.cpu_count() or 1) // num_workers)


def client_host(host: str) -> str:
    """Where a local client reaches a server bound to `host`."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def base_url(settings: Settings) -> str:
    host = client_host(settings.host)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{settings.port}"


def probe_ready(url: str, timeout_s: float = 2.0) -> bool:
    """True if GET `url` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def banner(settings: Settings) -> str:
    """Where to point a client, with a curl line that works as printed."""
    url = base_url(settings)
    auth = ' -H "Authorization: Bearer $LADLE_API_KEY"' if settings.api_keys else ""
    message = '[{"role": "user", "content": "Hello!"}]'
    body = f'{{"model": "{settings.model_id}", "messages": {message}, "max_tokens": 32}}'
    return (
        f"\n  Ladle is ready: {url}/v1  (model: {settings.model_id})\n"
        f"  OpenAI clients: base_url={url}/v1\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d '{body}'\n  metrics: {url}/metrics   stop: Ctrl-C\n"
    )


class SignalLatch:
    """Counts SIGINT/SIGTERM while installed; restores the previous handlers on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.count = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> SignalLatch:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: object) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            logger.warning("%s received: stopping (send it again to kill at once)", name)
        else:
            logger.warning("%s received again: killing the children", name)


def supervise(
    sup: Supervisor,
    latch: SignalLatch,
    ready_url: str,
    ready_timeout_s: float,
    on_ready: Callable[[], None],
    poll_s: float = 0.25,
    on_tick: Callable[[], None] = lambda: None,
) -> int:
    """Keep the children running until a signal (0). Exits early when a child refused its
    configuration (EXIT_CONFIG_ERROR: a restart cannot help, and serving without it would
    answer 503 forever), or (1) when every child has crash-looped and been given up."""
    started = time.monotonic()
    is_ready, warned, next_note = False, False, started + 15.0
    while not latch.count:
        sup.check()
        on_tick()
        refused = sup.refused()
        if refused:
            names = ", ".join(child.name for child in refused)
            logger.error("stopping: %s cannot start as configured (see its error above)", names)
            return EXIT_CONFIG_ERROR
        if sup.all_given_up():
            logger.error("every process crash-looped and was given up; exiting")
            return 1
        now = time.monotonic()
        if not is_ready and probe_ready(ready_url):
            is_ready = True
            on_ready()
        elif not is_ready and not warned and now - started > ready_timeout_s:
            warned = True
            logger.error(
                "not ready after %.0f s (%s); still trying: see the workers' logs",
                ready_timeout_s,
                ready_url,
            )
        elif not is_ready and now > next_note:
            logger.info("waiting for %s (workers load the model first)...", ready_url)
            next_note = now + 15.0
        time.sleep(poll_s if is_ready else min(poll_s, READY_POLL_S))
    return 0


def run_up(options: UpOptions) -> int:
    """Find or start Redis, start the API and the workers, supervise them; the exit code."""
    settings = settings_for(options)
    setup_logging(settings.log_level)
    try:
        broker = find_or_start_redis(
            settings.redis_url,
            allow_start=options.start_redis,
            is_default="redis_url" not in settings.model_fields_set,
        )
    except BrokerError as exc:
        logger.error("no Redis: %s", exc)
        return 1
    settings = settings.model_copy(update={"redis_url": broker.url})
    shutdown_s = options.shutdown_timeout_s
    if shutdown_s is None:
        shutdown_s = settings.shutdown_timeout_s + SHUTDOWN_MARGIN_S
    metrics = SupervisorMetrics()
    specs = child_specs(
        settings, options.num_workers, dict(os.environ), groups=options.worker_groups
    )
    sup = Supervisor(
        specs,
        RestartPolicy.from_settings(settings),
        on_restart=lambda name: metrics.restarts.labels(child=name).inc(),
    )
    publisher = StatusPublisher(broker.url, Keys(settings.key_prefix))
    _serve_metrics(settings, metrics)
    logger.info(
        "starting the API on %s and %d worker(s); Redis (%s) at %s",
        base_url(settings),
        len(specs) - 1,
        broker.kind,
        safe_url(broker.url),
    )
    try:
        with SignalLatch() as latch:
            sup.start()
            code = supervise(
                sup,
                latch,
                base_url(settings) + "/ready",
                options.ready_timeout_s,
                on_ready=lambda: print(banner(settings), flush=True),
                on_tick=lambda: _report(sup, metrics, publisher),
            )
            sup.stop(shutdown_s, force=lambda: latch.count > 1)
    finally:
        if sup.any_alive():  # an exception got here first
            sup.stop(0)
        publisher.remove()
        broker.stop()
    return code


def _report(sup: Supervisor, metrics: SupervisorMetrics, publisher: StatusPublisher) -> None:
    """The children's states as gauges, and in Redis for `/ready`."""
    statuses = sup.statuses()
    for status in statuses:
        metrics.child_up.labels(child=status.name).set(1 if status.state == "running" else 0)
        metrics.given_up.labels(child=status.name).set(1 if status.state == "given_up" else 0)
    publisher.publish(statuses)


def _serve_metrics(settings: Settings, metrics: SupervisorMetrics) -> None:
    port = settings.supervisor_metrics_port
    if not port:
        return
    try:
        start_http_server(port, addr=settings.host, registry=metrics.registry)
        logger.info("supervisor metrics on http://%s:%d/metrics", settings.host, port)
    except OSError as exc:
        logger.warning("supervisor metrics port %d unavailable: %s", port, exc)


__all__ = ["ChildSpec", "Supervisor", "describe_exit", "run_up", "supervise"]

"""The worker process owns start-up and shutdown: model, Redis, service, heartbeat, drain."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

from arq.connections import ArqRedis, create_pool
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from shared import tracing
from shared.config import Settings, active_allocator
from shared.contracts import WorkerRecord
from shared.keys import Keys
from shared.logging import safe_url
from shared.metrics import WorkerMetrics
from shared.queue import deserialize_job, serialize_job
from shared.redis_url import arq_redis_settings
from shared.redis_wire import pack_in_c
from shared.retry import FOREVER, Backoff, retry
from shared.tokenizer import Tokenizer, load_tokenizer
from shared.tool_format import tokenizer_tool_format
from worker.arq_adapter import LadleWorker, admission_capacity, lane_workers
from worker.engine.config import EngineConfig
from worker.engine.embedding import EmbeddingEngine, build_embedding_engine
from worker.engine.engine import EngineStats, LLMEngine
from worker.engine_thread import EngineHost
from worker.heartbeat import Heartbeat, default_worker_id
from worker.metrics import WorkerMetricsRecorder
from worker.models.pooling_loader import is_pooling_model
from worker.prefixes import PrefixPublisher
from worker.service import WorkerService

logger = logging.getLogger("worker")
CONNECT_BACKOFF = Backoff(first_s=0.5, max_s=5.0)


class WorkerProcess:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.worker_id = settings.worker_id or default_worker_id()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        s = self.settings
        tracing.configure(s.otel_endpoint, "ladle-worker", self.worker_id)
        pack_in_c()
        started = time.perf_counter()
        host = EngineHost()  # built and stepped on one thread: one OpenMP team
        build = build_embedding_engine if is_pooling_model(s.model_name, s.cache_dir) else LLMEngine
        engine = await asyncio.wrap_future(host.submit(build, EngineConfig.from_settings(s)))
        tokenizer = (
            engine.tokenizer  # a generator has loaded it already (0.2-0.3 s)
            if isinstance(engine, LLMEngine)
            else await asyncio.to_thread(load_tokenizer, s.model_name, s.cache_dir)
        )
        logger.info(
            "engine ready in %.1f s (allocator: %s)",
            time.perf_counter() - started,
            active_allocator(),
        )
        pool = await _connect(s)
        metrics = WorkerMetrics()
        recorder = WorkerMetricsRecorder(metrics)
        service = WorkerService(
            s, engine, tokenizer, pool, self.worker_id, recorder, engine_host=host
        )
        service.start()
        service.prefixes = self._prefix_publisher(pool, service)
        heartbeat = Heartbeat(
            pool,
            self.keys,
            self._record(engine, service.engine_thread.stats, tokenizer),
            s.heartbeat_interval_s,
            s.worker_ttl_s,
            stats=lambda: _stats(service, recorder),
            job_ids=lambda: list(service.jobs),
            status=lambda: service.status,
            restore=service.restore_records,
            generated_tokens=lambda: recorder.num_generation_tokens,
            prefixes=service.prefixes,
        )
        heartbeat.start()
        self._serve_metrics(metrics)
        workers = lane_workers(service, s, pool)
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, self._stopping.set)
        runners = [asyncio.create_task(w.async_run()) for w in workers]
        for runner in runners:
            runner.add_done_callback(self._on_runner_exit)
        logger.info(
            "worker %s ready: model %s on %s", self.worker_id, s.model_id, engine.executor.device
        )
        await self._stopping.wait()
        await self._drain(service, workers)
        await heartbeat.stop()
        await heartbeat.remove()
        for runner in runners:
            runner.cancel()
        await asyncio.gather(*runners, return_exceptions=True)
        await workers[0].close()  # closes the shared pool too: the other worker only waits
        await asyncio.gather(*workers[1].tasks.values(), return_exceptions=True)
        await service.stop()
        tracing.shutdown()
        logger.info("worker %s stopped", self.worker_id)

    async def _drain(self, service: WorkerService, workers: list[LadleWorker]) -> None:
        """Stop taking jobs; let running ones finish within the timeout; hand back the rest."""
        service.draining = True
        for worker in workers:
            worker.allow_pick_jobs = False
        logger.info(
            "draining %d jobs (up to %.0f s)", len(service.jobs), self.settings.shutdown_timeout_s
        )
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        while (service.jobs or service.num_pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        handed = service.hand_back_all()
        if handed:
            logger.info("handing %d unfinished jobs back to the queue", len(handed))
        tasks = [t for w in workers for t in w.tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=10)

    def _on_runner_exit(self, runner: asyncio.Task[None]) -> None:
        """The poll loop never ends by itself: if it does, exit (a supervisor restarts us)
        rather than heartbeat as a worker that takes no jobs."""
        if not self._stopping.is_set():
            exc = None if runner.cancelled() else runner.exception()
            logger.error("the arq poll loop ended (%r); stopping", exc)
            self._stopping.set()

    def _prefix_publisher(self, pool: ArqRedis, service: WorkerService) -> PrefixPublisher | None:
        """What the prefix cache holds, for the API's router (a generating model's, if on)."""
        s = self.settings
        if not (s.prefix_routing and s.enable_prefix_caching) or not isinstance(
            service.engine, LLMEngine
        ):
            return None
        return PrefixPublisher(
            pool,
            self.keys,
            self.worker_id,
            s.model_id,
            s.worker_ttl_s,
            stats=lambda: service.engine_thread.stats,
            room=lambda: admission_capacity(service, "interactive"),
        )

    def _record(
        self, engine: LLMEngine | EmbeddingEngine, stats: EngineStats, tokenizer: Tokenizer
    ) -> WorkerRecord:
        pooling = engine.model_info() if isinstance(engine, EmbeddingEngine) else {}
        tools = None if pooling else tokenizer_tool_format(tokenizer)
        return WorkerRecord(
            **pooling,
            tool_format=tools,
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.settings.model_id,
            model_source=self.settings.model_name,
            device=engine.executor.device,
            dtype=engine.executor.dtype,
            architecture=_architecture(engine),
            weight_precision=_weight_precision(engine.executor.quantization, engine.executor.dtype),
            compiled=engine.executor.compiled,
            deterministic=engine.executor.deterministic,
            deterministic_reason=engine.executor.deterministic_reason,
            kernels=engine.executor.kernels,
            max_model_len=engine.max_model_len,
            block_size=stats.block_size,
            kv_blocks_total=stats.num_blocks_total,
            kv_bytes_per_block=stats.kv_bytes_per_block,
        )

    def _serve_metrics(self, metrics: WorkerMetrics) -> None:
        port = self.settings.worker_metrics_port
        if not port:
            return
        try:
            start_http_server(port, addr=self.settings.host, registry=metrics.registry)
            logger.info("worker metrics on http://%s:%d/metrics", self.settings.host, port)
        except OSError as exc:
            logger.warning("worker metrics port %d unavailable: %s", port, exc)


def _architecture(engine: LLMEngine | EmbeddingEngine) -> str:
    """The HF class the served checkpoint names ("" where the executor does not say)."""
    loaded = getattr(engine.executor, "loaded", None)
    names = getattr(getattr(loaded, "hf_config", None), "architectures", None) or [""]
    return str(names[0])


def _weight_precision(quantization: str, dtype: str) -> str:
    """int8 / int4 (or "auto (int4 x N, ...)") where projections are quantized, else the
    model's dtype."""
    return dtype if quantization in ("", "none") else quantization


def _stats(service: WorkerService, recorder: WorkerMetricsRecorder) -> EngineStats:
    """The engine thread's last snapshot, recorded in the metrics (on the heartbeat thread)."""
    stats = service.engine_thread.stats
    recorder.observe_stats(stats)
    return stats


async def _connect(settings: Settings) -> ArqRedis:
    """arq's pool; waits for Redis forever (a worker without Redis has nothing to do)."""
    return await retry(
        lambda: create_pool(
            arq_redis_settings(settings.redis_url),
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            default_queue_name=Keys(settings.key_prefix).queue(settings.model_id),
        ),
        on=(RedisError, OSError),
        what=f"connecting to Redis at {safe_url(settings.redis_url)}",
        backoff=CONNECT_BACKOFF,
        give_up_after_s=FOREVER,
    )

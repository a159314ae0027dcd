"""`python -m worker`: one worker process, one model, one engine loop, jobs from arq."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from typing import Any

from arq import Retry
from arq.connections import ArqRedis, create_pool
from arq.worker import Worker, func
from prometheus_client import start_http_server
from redis.exceptions import RedisError

from shared.config import Settings, settings_with
from shared.contracts import ErrorEvent, JobPayload, Lane, WorkerRecord
from shared.keys import Keys
from shared.logging import job_id_var, request_id_var, setup_logging
from shared.metrics import WorkerMetrics
from shared.queue import RUN_COMPLETION, deserialize_job, serialize_job
from shared.redis_url import arq_redis_settings
from shared.tokenizer import load_tokenizer
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.heartbeat import ARQ_IN_PROGRESS_PREFIX, Heartbeat, default_worker_id
from worker.metrics import WorkerMetricsRecorder
from worker.service import HandBack, WorkerService
from worker.store import REDIS_DOWN_ERRORS

# How often a worker looks at the queue when nothing wakes it: jobs handed back or retried,
# room freed by finished jobs. A new job wakes idle workers at once (the API publishes on
# Keys.wake_channel after enqueueing).
POLL_S = 0.02
# Batch lines are not woken for: their lane is looked at this often.
BATCH_POLL_S = 0.1

logger = logging.getLogger("worker")


async def run_completion(ctx: dict[str, Any], payload_json: str) -> str:
    """The arq job: one attempt at one completion job."""
    service: WorkerService = ctx["service"]
    payload = JobPayload.model_validate_json(payload_json)
    # Log lines of this job (its own asyncio task) carry its ids.
    job_id_var.set(payload.id)
    request_id_var.set(payload.request_id)
    try:
        status = await service.run_job(payload, ctx["job_try"])
        logger.info("job %s", status, extra={"attempt": ctx["job_try"]})
        return status
    except HandBack:
        raise Retry(defer=None) from None  # back to the queue, for another worker
    except asyncio.CancelledError:
        raise
    except REDIS_DOWN_ERRORS as exc:  # Redis stayed away past the store's deadline
        logger.error("job %s: Redis unreachable (%r); back to the queue", payload.id, exc)
        raise Retry(defer=1.0) from None
    except Exception as exc:  # a bug must end the job with a reason, never lose it
        logger.exception("job %s failed", payload.id)
        await service.fail(
            payload.id,
            ErrorEvent(status=500, error_type="server_error", message=f"worker error: {exc}"),
        )
        return "failed"


class LadleWorker(Worker):
    """arq's worker for one lane of the worker's model, taking only jobs the engine can start
    soon (batch lines: only spare room) and surviving Redis blips."""

    def __init__(
        self,
        service: WorkerService,
        settings: Settings,
        pool: ArqRedis,
        lane: Lane = "interactive",
    ) -> None:
        super().__init__(
            functions=[func(run_completion, name=RUN_COMPLETION, max_tries=settings.job_max_tries)],
            queue_name=Keys(settings.key_prefix).queue(settings.model_id, lane),
            redis_pool=pool,
            max_jobs=settings.max_batch_size + settings.worker_max_queued,
            job_timeout=settings.job_timeout_s + 30,
            keep_result=60,
            poll_delay=0,  # the wait is ours: POLL_S, or less when the API wakes us
            handle_signals=False,
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            ctx={"service": service},
            log_results=False,
        )
        # A killed worker's lease runs out after worker_ttl_s (the heartbeat renews it).
        self.in_progress_timeout_s = settings.worker_ttl_s
        self.service = service
        self.lane = lane
        self._poll_delay = 0.5

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        # arq lists jobs running anywhere as well: check room per job actually started,
        # never cut the list (that starved the worker at worker_max_queued jobs).
        for job_id in await self._not_running(job_ids):
            if self._capacity() <= 0:
                return
            counter = self.job_counter
            try:
                await super().start_jobs([job_id])
            except BaseException:
                # arq counted the job and took a semaphore slot before its Redis calls
                # failed: give both back, or every outage would shrink max_jobs for good.
                if self.job_counter > counter and job_id.decode() not in self.tasks:
                    self.job_counter -= 1
                    self.sem.release()
                raise

    async def _not_running(self, job_ids: list[bytes]) -> list[bytes]:
        """Drop the ids of jobs already running, here or elsewhere, before arq's own check.

        Running jobs stay in arq's queue until they end, and arq checks each listed id with
        a WATCH/EXISTS/ZSCORE/UNWATCH round of its own: at 16 running jobs and one poll every
        20 ms that was most of the worker's event-loop CPU (2 ms per generated token), taken
        from the engine thread. Ours are known from `self.tasks`; others' in-progress keys
        cost one pipelined EXISTS per poll. arq still checks the rest (a race stays safe)."""
        ids = [i for i in job_ids if not _running(self.tasks.get(i.decode()))]
        if not ids:
            return []
        async with self.pool.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.exists(ARQ_IN_PROGRESS_PREFIX + job_id.decode())
            found = await pipe.execute()
        return [job_id for job_id, running in zip(ids, found, strict=True) if not running]

    def _capacity(self) -> int:
        """Room for more jobs, counting those arq started that are not yet in the engine."""
        service = self.service
        num_starting = max(self.job_counter - len(service.jobs) - service.num_pending, 0)
        return service.admission_capacity(num_starting, self.lane)

    async def _poll_iteration(self) -> None:
        """One poll, then a wait of POLL_S cut short by a wake-up (the API enqueued a job).

        A Redis outage (or anything else) must not end the poll loop."""
        try:
            await super()._poll_iteration()
            self._poll_delay = 0.5
            if self.lane != "interactive":
                await asyncio.sleep(BATCH_POLL_S)
                return
            wake = self.service.wake
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), POLL_S)
            wake.clear()
        except (RedisError, OSError) as exc:
            logger.warning("queue poll failed (%s); retrying in %.1f s", exc, self._poll_delay)
            await asyncio.sleep(self._poll_delay)
            self._poll_delay = min(self._poll_delay * 2, 5.0)
        except Exception:
            logger.exception("queue poll failed")
            await asyncio.sleep(1.0)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq gave up on a job without running it (tries exhausted): record why.

        arq notices only when a worker picks the job up again after the last attempt's
        worker died (its lease ran out), so the record says `in_progress` until then."""
        await super().finish_failed_job(job_id, result_data)
        tries = self.service.settings.job_max_tries
        logger.warning("job %s: no try left after %d attempts; failing it", job_id, tries)
        await self.service.fail(
            job_id,
            ErrorEvent(
                status=500,
                error_type="server_error",
                code="worker_lost",
                message=f"The job failed after {tries} attempts: its worker was lost each time",
            ),
        )


class WorkerProcess:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.keys = Keys(settings.key_prefix)
        self.worker_id = settings.worker_id or default_worker_id()
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        s = self.settings
        started = time.perf_counter()
        engine = await asyncio.to_thread(LLMEngine, EngineConfig.from_settings(s))
        tokenizer = await asyncio.to_thread(load_tokenizer, s.model_name, s.cache_dir)
        logger.info("engine ready in %.1f s", time.perf_counter() - started)
        pool = await _connect(s)
        metrics = WorkerMetrics()
        recorder = WorkerMetricsRecorder(metrics)
        service = WorkerService(s, engine, tokenizer, pool, self.worker_id, recorder)
        service.start()
        heartbeat = Heartbeat(
            pool,
            self.keys,
            self._record(engine),
            s.heartbeat_interval_s,
            s.worker_ttl_s,
            stats=lambda: _stats(engine, recorder),
            job_ids=lambda: list(service.jobs),
            status=lambda: "draining" if service.draining else "ready",
            restore=service.restore_records,
        )
        heartbeat.start()
        self._serve_metrics(metrics)
        # One arq worker per lane of this model's queues, sharing the engine and admission.
        workers = [LadleWorker(service, s, pool, lane) for lane in ("interactive", "batch")]
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

    def _record(self, engine: LLMEngine) -> WorkerRecord:
        stats = engine.stats()
        return WorkerRecord(
            worker_id=self.worker_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            model=self.settings.model_id,
            model_source=self.settings.model_name,
            device=engine.executor.device,
            dtype=engine.executor.dtype,
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


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()


def _stats(engine: LLMEngine, recorder: WorkerMetricsRecorder):  # noqa: ANN202
    stats = engine.stats()
    recorder.observe_stats(stats)
    return stats


async def _connect(settings: Settings) -> ArqRedis:
    delay = 0.5
    while True:
        try:
            return await create_pool(
                arq_redis_settings(settings.redis_url),
                job_serializer=serialize_job,
                job_deserializer=deserialize_job,
                default_queue_name=Keys(settings.key_prefix).queue(settings.model_id),
            )
        except (RedisError, OSError) as exc:
            logger.warning("Redis at %s unavailable (%s); retrying", _safe_url(settings), exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


def _safe_url(settings: Settings) -> str:
    url = settings.redis_url
    return url.split("@", 1)[-1] if "@" in url else url


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Run one Ladle worker: loads the model, takes completion jobs from Redis "
        "(arq), runs them in the continuous-batching engine and streams tokens "
        "back. Settings come from LLM_* environment variables and .env.",
    )
    parser.add_argument("--model", help="overrides LLM_MODEL_NAME")
    parser.add_argument(
        "--served-model-name", help="the name clients use (overrides LLM_SERVED_MODEL_NAME)"
    )
    parser.add_argument("--redis-url", help="overrides LLM_REDIS_URL")
    parser.add_argument("--worker-id", help="overrides LLM_WORKER_ID")
    parser.add_argument("--metrics-port", type=int, help="overrides LLM_WORKER_METRICS_PORT")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_with(
        model_name=args.model,
        served_model_name=args.served_model_name,
        redis_url=args.redis_url,
        worker_id=args.worker_id,
        worker_metrics_port=args.metrics_port,
    )
    setup_logging(settings.log_level)
    asyncio.run(WorkerProcess(settings).run())
    return 0

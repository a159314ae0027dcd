"""The job lifecycle: one attempt of a job from its record to its one final state.

`WorkerService` checks and claims a job, hands it to the engine thread, waits for its outcome
(completed, cancelled, timed out, rejected, handed back) and writes the final record. Engine
outputs become events in `worker/publisher.py`; cancels arrive through `worker/listener.py`;
which jobs to take is the arq adapter's call (`worker/arq_adapter.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.config import Settings
from shared.contracts import (
    FINAL_STATUSES,
    POOLING_ENDPOINTS,
    ErrorEvent,
    JobPayload,
    JobRecord,
    JobStatus,
    RestartEvent,
    StartedEvent,
    cancelled_event,
    error_event,
)
from shared.errors import InvalidRequestError
from shared.relay_shards import keys_for, stream_shards
from shared.tokenizer import Tokenizer
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.embedding import EmbeddingEngine, EmbeddingRequest
from worker.engine.engine import LLMEngine, PreparedRequest
from worker.engine_thread import EngineHost, EngineStepError, EngineThread
from worker.job_state import JobState, Outcome, job_for, new_engine_request_id
from worker.job_writer import JobWriter
from worker.listener import Listener
from worker.metrics import WorkerMetricsRecorder
from worker.prefixes import PrefixPublisher
from worker.publisher import Publisher
from worker.tracing import record_attempt
from worker.watchdog import StallWatchdog

logger = logging.getLogger(__name__)


class HandBack(Exception):
    """The job was not finished here and goes back to the queue (shutdown)."""


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        engine: LLMEngine | EmbeddingEngine,
        tokenizer: Tokenizer,
        redis: Redis,
        worker_id: str,
        metrics: WorkerMetricsRecorder | None = None,
        engine_host: EngineHost | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.redis = redis
        self.worker_id = worker_id
        self.keys = keys_for(settings)
        shards = stream_shards(redis, settings, socket_connect_timeout=2.0)
        self.store = JobWriter(
            redis, self.keys, settings.job_ttl_s, settings.stream_maxlen, shards=shards
        )
        self.jobs: dict[str, JobState] = {}
        self.num_pending = 0
        self.draining = False
        self.loop = asyncio.get_running_loop()
        self.publisher = Publisher(
            redis, self.store, self.jobs, tokenizer, self._on_job_written, metrics
        )
        self.engine_thread = EngineThread(
            engine, self.publisher.on_outputs, self._on_reject, host=engine_host
        )
        self._tasks: list[asyncio.Task[None]] = []
        self.metrics = metrics
        # Set when the API has enqueued a job: the poll loop looks at the queue at once.
        self.wake = asyncio.Event()
        self.listener = Listener(redis, self.keys, self.cancel, self.wake)
        self.watchdog = StallWatchdog(
            self.engine_thread, settings.engine_stall_s, self.hand_back_all
        )
        # Set by the process when requests are routed by prefix (LLM_PREFIX_ROUTING).
        self.prefixes: PrefixPublisher | None = None

    def is_unhealthy(self) -> bool:
        """The engine thread is stuck in a step (`worker/watchdog.py`)."""
        return self.watchdog.is_stalled

    @property
    def status(self) -> str:
        """What the heartbeat reports."""
        if self.draining:
            return "draining"
        return "unhealthy" if self.is_unhealthy() else "ready"

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self.engine_thread.start()
        self.watchdog.start()
        self._tasks.append(asyncio.create_task(self.publisher.run(), name="publisher"))
        self._tasks.append(asyncio.create_task(self.listener.run(), name="cancels+wake"))

    @property
    def ends_jobs_in_one_step(self) -> bool:
        """An embedding or scoring engine: every job finishes in the step that runs it."""
        return isinstance(self.engine, EmbeddingEngine)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.watchdog.stop()
        await asyncio.to_thread(self.engine_thread.stop)

    # ---- one job -----------------------------------------------------------------------

    async def run_job(self, payload: JobPayload, attempt: int) -> JobStatus | Literal["skipped"]:
        """Run one attempt of a job to its final event; returns the final status."""
        picked_at = time.time()
        record = await self.store.get(payload.id)
        if record is None or record.status in FINAL_STATUSES:
            return "skipped"
        if await self.store.is_cancelled(payload.id):
            await self._finish(record, "cancelled", cancelled_event())
            return "cancelled"
        self.num_pending += 1
        try:
            if not await self.store.mark_in_progress(record, attempt, self.worker_id):
                return "skipped"  # another attempt ended it since `get`
            if attempt > 1:
                reason = "the previous attempt's worker was lost or shut down"
                await self.store.append_now(
                    payload.id, RestartEvent(attempt=attempt, reason=reason)
                )
            engine_request_id = new_engine_request_id(payload.id)
            prepared = self._prepare(payload, engine_request_id)
        except InvalidRequestError as exc:
            await self._finish(record, "failed", error_event(exc))
            return "failed"
        finally:
            self.num_pending -= 1
        all_prompt_ids = [t for request in prepared for t in request.prompt_token_ids]
        job = JobState.create(
            payload, attempt, all_prompt_ids, self.loop, picked_at, engine_request_id
        )
        job.record_json = record.model_dump_json()
        self.jobs[payload.id] = job
        if self.metrics:
            self.metrics.observe_job_started(job)
        await self.store.append_now(
            payload.id,
            StartedEvent(
                worker_id=self.worker_id,
                prompt_tokens=len(all_prompt_ids),
                attempt=attempt,
            ),
        )
        for request in prepared:
            self.engine_thread.add(request)
        return await self._await_outcome(record, job)

    async def _await_outcome(self, record: JobRecord, job: JobState) -> JobStatus:
        job_id = record.id
        timeout = self.settings.job_timeout_s
        if job.payload.deadline is not None:
            timeout = min(timeout, max(job.payload.deadline - time.time(), 0.0))
        try:
            outcome: Outcome = await asyncio.wait_for(asyncio.shield(job.outcome), timeout)
        except TimeoutError:
            self.engine_thread.abort(job.engine_request_id)
            outcome = "timeout"
        except (asyncio.CancelledError, HandBack) as exc:
            self.engine_thread.abort(job.engine_request_id)
            self.jobs.pop(job_id, None)
            record_attempt(job, self.worker_id, type(exc).__name__)
            raise
        publish_started = time.time()
        if outcome == "completed":
            await self._publish_prefixes()
        try:  # still listed while its final write waits out Redis: the heartbeat restores it
            await self._finish_outcome(record, job, outcome)
        finally:
            self.jobs.pop(job_id, None)
        record_attempt(job, self.worker_id, outcome, (publish_started, time.time()))
        return record.status

    async def _publish_prefixes(self) -> None:
        """The blocks this job left, published before its answer: the next turn follows it."""
        if self.prefixes is None:
            return
        try:
            await self.prefixes.publish()
        except (RedisError, OSError) as exc:  # only routing suffers; the heartbeat tries again
            logger.debug("prefix fingerprint not published: %r", exc)

    async def _finish_outcome(self, record: JobRecord, job: JobState, outcome: Outcome) -> None:
        if outcome == "completed":
            done = job.done_event()
            record.result = job.result()
            await self._finish(record, "completed", done)
            if self.metrics:
                self.metrics.observe_job_finished(job)
        elif outcome == "cancelled":
            await self._finish(record, "cancelled", cancelled_event())
        elif outcome == "timeout":
            await self._finish(
                record,
                "failed",
                ErrorEvent(
                    status=504,
                    error_type="timeout",
                    code="deadline_exceeded",
                    message="the job did not finish before its deadline",
                ),
            )
        else:  # rejected by the engine
            await self._finish(record, "failed", job.error)

    def _prepare(
        self, payload: JobPayload, engine_request_id: str
    ) -> list[PreparedRequest] | list[EmbeddingRequest]:
        """The job's token ids as the API sent them (never tokenized again) and its params:
        one engine request per prompt, its choices numbered from prompt * n (an embedding
        or scoring job: one input per prompt)."""
        if isinstance(self.engine, EmbeddingEngine):
            if payload.endpoint not in POOLING_ENDPOINTS:
                raise InvalidRequestError(
                    f"model {payload.model} serves embeddings and scores, not {payload.endpoint}"
                )
            return self.engine.prepare_job(payload, engine_request_id)
        if payload.endpoint in POOLING_ENDPOINTS:
            raise InvalidRequestError(
                f"model {payload.model} generates text: no {payload.endpoint}"
            )
        try:
            params = SamplingParams(**payload.sampling.model_dump())
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        prepared = []
        for number, prompt_ids in enumerate(payload.prompts):
            request = self.engine.prepare(
                engine_request_id,
                prompt_ids,
                params,
                payload.priority,
                param_name=payload.prompt_param,
                lane=payload.lane,
                grammar=payload.structured.grammar if payload.structured else None,
            )
            request.first_index = number * params.n
            prepared.append(request)
        return prepared

    async def _finish(self, record: JobRecord, status: str, event: object) -> None:
        record.status = status  # type: ignore[assignment]
        if isinstance(event, ErrorEvent):
            record.error = event
        job = self.jobs.get(record.id)
        payload_json = job.payload.model_dump_json() if job is not None else ""
        used = job.usage().total_tokens if job is not None else 0  # never ran: nothing used
        await self.store.finish(record, event, payload_json, used)

    async def fail(self, job_id: str, error: ErrorEvent) -> None:
        """End a job as failed with a reason, unless it already ended."""
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self.engine_thread.abort(job.engine_request_id)
        record = await self.store.get(job_id)
        if record is not None:
            await self._finish(record, "failed", error)

    def restore_records(self, pipe: Redis) -> None:
        """Queue writes that put back running jobs' records if Redis lost them (heartbeat)."""
        for job_id, job in list(self.jobs.items()):
            if job.record_json is not None:
                self.store.restore(pipe, job_id, job.record_json, job.payload.model_dump_json())

    def cancel(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None and not job.outcome.done():
            self.engine_thread.abort(job.engine_request_id)
            job.outcome.set_result("cancelled")

    def hand_back_all(self) -> list[str]:
        """Abort every running job so its arq task can re-queue it (shutdown)."""
        job_ids = [jid for jid, job in self.jobs.items() if not job.outcome.done()]
        for job_id in job_ids:
            self.engine_thread.abort(self.jobs[job_id].engine_request_id)
            self.jobs[job_id].outcome.set_exception(HandBack(job_id))
        return job_ids

    # ---- engine thread and publisher -> lifecycle --------------------------------------

    def _on_job_written(self, job: JobState) -> None:
        """The publisher wrote a job's last token: it completed."""
        if not job.outcome.done():
            job.outcome.set_result("completed")

    def _on_reject(self, request_id: str, exc: Exception) -> None:
        self.loop.call_soon_threadsafe(self._reject, request_id, exc)

    def _reject(self, request_id: str, exc: Exception) -> None:
        job = job_for(self.jobs, request_id)
        if job is None or job.outcome.done():
            return
        if isinstance(exc, EngineStepError):
            job.error = error_event(exc)
        else:  # the engine refused the request
            job.error = error_event(exc, 400, "invalid_request_error")
        job.outcome.set_result("rejected")

"""The arq adapter owns the queue side: the job function, the arq Worker, and admission.

arq has no public hook for three things we need, so `LadleWorker` overrides them and says why
at each: `start_jobs` (admission: take only what the engine can start soon), `_poll_iteration`
(a poll that survives Redis outages and a wait cut short by the API's wake-up), and
`finish_job`/`finish_failed_job` (wake the workers for a job handed back; record why a job
ran out of tries). Everything else is arq's public API.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from arq import Retry
from arq.connections import ArqRedis
from arq.worker import Worker, func
from redis.exceptions import RedisError

from shared.config import Settings
from shared.contracts import ErrorEvent, JobPayload, Lane, error_event
from shared.keys import Keys
from shared.logging import job_id_var, request_id_var
from shared.queue import RUN_COMPLETION, deserialize_job, serialize_job
from shared.retry import FOREVER, Backoff, retry
from worker.heartbeat import ARQ_IN_PROGRESS_PREFIX
from worker.job_writer import REDIS_DOWN_ERRORS
from worker.service import HandBack, WorkerService

# How often a worker looks at the queue while a job it could not take waits there (no room
# yet, or held for another worker's cache): room frees and holds end without a wake-up.
POLL_S = 0.02
# How often when its last look found nothing to wait for. A new job wakes every worker at
# once (the API publishes on Keys.wake_channel after enqueueing); this finds what nothing
# announces: a job handed back or retried, a lost worker's lease run out, a lost wake-up.
# At POLL_S an idle worker, or one running a single stream, spent 5 % of a core on polls.
IDLE_POLL_S = 0.25
# Batch lines are not woken for: their lane is looked at this often, or at BATCH_IDLE_POLL_S
# when it was empty.
BATCH_POLL_S = 0.1
BATCH_IDLE_POLL_S = 1.0
POLL_BACKOFF = Backoff(first_s=0.5, max_s=5.0)

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
            error_event(exc, message=f"worker error: {exc}"),
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
        self.settings = settings
        self.lane = lane
        self.keys = Keys(settings.key_prefix)
        # Set by a poll that left a job it may take soon: the next poll comes after POLL_S.
        self.look_again_soon = False

    async def main(self) -> None:
        """arq's main, retried while its start-up Redis calls fail.

        arq reads Redis's INFO (`log_redis_info`) before its poll loop, outside
        `_poll_iteration`: one connect timeout there ended the worker. We set no
        `on_startup` and the poll loop never raises, so running main again is safe."""
        await _until_redis_answers(super().main, "queue start-up")

    async def start_jobs(self, job_ids: list[bytes]) -> None:
        """Admission. arq offers every queued id it read and has no hook to decline one, so
        this override checks room per job actually started. arq lists jobs running anywhere
        as well: never cut the list (that starved the worker at worker_max_queued jobs)."""
        for job_id in await self._not_running(job_ids):
            if self.admission_capacity() <= 0:
                self.look_again_soon = True  # it waits for room here
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

    def admission_capacity(self) -> int:
        """Room for more jobs of this lane, counting those arq started that are not yet in
        the engine (`job_counter` is arq's count of the jobs it started)."""
        service = self.service
        num_starting = max(self.job_counter - len(service.jobs) - service.num_pending, 0)
        return admission_capacity(service, self.lane, num_starting)

    async def _not_running(self, job_ids: list[bytes]) -> list[bytes]:
        """Drop the ids of jobs already running, here or elsewhere, and of jobs held for
        another worker (routed to its prefix cache, `Keys.routed`), before arq's own check.
        A held job sets `look_again_soon`: anyone may take it when its hold ends.

        Running jobs stay in arq's queue until they end, and arq checks each listed id with
        a WATCH/EXISTS/ZSCORE/UNWATCH round of its own: at 16 running jobs and one poll every
        20 ms that was most of the worker's event-loop CPU (2 ms per generated token), taken
        from the engine thread. Ours are known from `self.tasks`; others' in-progress keys
        and holds cost one pipeline per poll. arq still checks the rest (a race stays safe)."""
        ids = [i for i in job_ids if not _running(self.tasks.get(i.decode()))]
        if not ids:
            return []
        async with self.pool.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.exists(ARQ_IN_PROGRESS_PREFIX + job_id.decode())
                pipe.get(self.keys.routed(job_id.decode()))
            found = await pipe.execute()
        mine = self.service.worker_id.encode()
        free = []
        for job_id, running, held_for in zip(ids, found[::2], found[1::2], strict=True):
            if held_for not in (None, mine):
                self.look_again_soon = True  # anyone may take it when its hold ends
            elif not running:
                free.append(job_id)
        return free

    async def _poll_iteration(self) -> None:
        """One poll, then a wait cut short by a wake-up (the API enqueued a job): POLL_S when
        the poll left a job this worker may take soon, IDLE_POLL_S when it did not.

        Private in arq, overridden because arq has no hook for either: its poll loop ends on
        the first Redis error, and its wait between polls is a fixed sleep. Redis errors are
        retried here forever, anything else is logged: nothing may end the poll loop."""
        try:
            self.look_again_soon = False
            await _until_redis_answers(super()._poll_iteration, "queue poll")
            # At max_jobs arq reads nothing, and jobs may wait for the room that frees.
            soon = self.look_again_soon or self.job_counter >= self.max_jobs
            if self.lane != "interactive":
                await asyncio.sleep(BATCH_POLL_S if soon else BATCH_IDLE_POLL_S)
                return
            wake = self.service.wake
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), POLL_S if soon else IDLE_POLL_S)
            wake.clear()
        except Exception:
            logger.exception("queue poll failed")
            await asyncio.sleep(1.0)

    async def finish_job(
        self,
        job_id: str,
        finish: bool,
        result_data: bytes | None,
        result_timeout_s: float | None,
        keep_result_forever: bool,
        incr_score: int | None,
        keep_in_progress: float | None,
    ) -> None:
        """arq's end of an attempt. A job left in the queue to run now (handed back by a
        draining worker, or its attempt cut short) wakes the workers, which would otherwise
        find it at their next idle poll (IDLE_POLL_S)."""
        await super().finish_job(
            job_id,
            finish,
            result_data,
            result_timeout_s,
            keep_result_forever,
            incr_score,
            keep_in_progress,
        )
        if not finish and incr_score is None:
            with contextlib.suppress(RedisError, OSError):  # the idle poll finds it anyway
                await self.pool.publish(self.keys.wake_channel, job_id)

    async def finish_failed_job(self, job_id: str, result_data: bytes | None) -> None:
        """arq gave up on a job without running it (tries exhausted): record why.

        arq notices only when a worker picks the job up again after the last attempt's
        worker died (its lease ran out), so the record says `in_progress` until then."""
        await super().finish_failed_job(job_id, result_data)
        tries = self.settings.job_max_tries
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


def admission_capacity(service: WorkerService, lane: Lane, num_starting: int = 0) -> int:
    """How many more jobs of `lane` to take from its queue now: only what can start soon.
    Every arq worker of the process (one per lane) shares the engine and this rule.

    Interactive: at most `worker_max_queued` jobs wait in the engine (or on their way to it:
    `num_starting` jobs arq has started that have not reached `run_job` yet), and at most
    `max_batch_size + worker_max_queued` in all, so a worker whose KV cache is full does not
    hoard jobs an idle worker could run. Batch lines only fill spare capacity: none while
    anything waits for the engine, never the last `batch_reserved_seqs` sequence slots (kept
    for interactive requests), and at most `batch_max_seqs` at once (a step's length, which an
    arriving interactive request waits out, grows with the batch)."""
    if service.draining or service.is_unhealthy():
        return 0
    if service.ends_jobs_in_one_step:
        return _pooling_room(service, lane, num_starting)
    room = _interactive_room(service, num_starting)
    if lane == "batch":
        return min(room, _batch_room(service, num_starting))
    return room


def _interactive_room(service: WorkerService, num_starting: int) -> int:
    settings = service.settings
    num_not_in_engine = service.num_pending + num_starting
    waiting = service.engine_thread.stats.num_waiting + num_not_in_engine
    room_in_queue = settings.worker_max_queued - waiting
    room_in_batch = (
        settings.max_batch_size + settings.worker_max_queued - len(service.jobs) - num_not_in_engine
    )
    return max(0, min(room_in_batch, max(room_in_queue, 0)))


def _batch_room(service: WorkerService, num_starting: int) -> int:
    s = service.settings
    if service.engine_thread.stats.num_waiting:
        return 0
    num_lines = sum(1 for job in service.jobs.values() if job.payload.lane == "batch")
    room_left = s.max_batch_size - s.batch_reserved_seqs - len(service.jobs) - service.num_pending
    return max(0, min(room_left, s.batch_max_seqs - num_lines) - num_starting)


def _pooling_room(service: WorkerService, lane: Lane, num_starting: int) -> int:
    """An embedding or scoring job ends in the step that runs it: there is no running set to
    keep room for, so take what fills the next step (`max_batch_size` inputs) plus
    `worker_max_queued`. Batch lines fill that room too, except the `batch_reserved_seqs`
    slots; a step takes interactive inputs first, so an interactive request waits at most one
    step behind them. (The generator's rule of 4 queued jobs held embedding lines to ~40/s.)"""
    s = service.settings
    in_flight = len(service.jobs) + service.num_pending + num_starting
    room = s.max_batch_size + s.worker_max_queued - in_flight
    if lane == "batch":
        room = min(room, s.max_batch_size - s.batch_reserved_seqs - in_flight)
    return max(0, room)


def _running(task: asyncio.Task | None) -> bool:
    return task is not None and not task.done()


async def _until_redis_answers(op: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `op`, retrying Redis and socket errors forever (arq's own code gives up on one)."""
    await retry(
        op, on=(RedisError, OSError), what=what, backoff=POLL_BACKOFF, give_up_after_s=FOREVER
    )


def lane_workers(service: WorkerService, settings: Settings, pool: ArqRedis) -> list[LadleWorker]:
    """One arq worker per lane in `LLM_WORKER_LANES`, all over the one engine and admission."""
    return [LadleWorker(service, settings, pool, lane) for lane in settings.worker_lanes]

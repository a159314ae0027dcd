"""The batch control queue's consumer: an arq worker inside each API process (unless
LLM_BATCH_CONTROL=false) that runs `batch_expand` and `batch_collect` jobs.

arq gives the durability: a job stays in the queue until it returns, and one whose process
died is run again once its lease (`LEASE_S`) runs out. Failures that can pass (Redis away,
a tokenizer still loading) are retried with a delay instead of dropping the step.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from arq import Retry
from arq.worker import Worker, func

from api.batches.runner import BatchRunner, ControlQueue
from api.services import Services
from shared.queue import deserialize_job, serialize_job

log = logging.getLogger(__name__)
JOB_TIMEOUT_S = 60.0
LEASE_S = 75.0  # longer than any one step; a dead process's step restarts after this
RETRY_DELAY_S = 2.0


async def _run_step(name: str, step: Any) -> None:
    try:
        await step
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("batch step %s failed (%r); retrying", name, exc)
        raise Retry(defer=RETRY_DELAY_S) from exc


async def batch_expand(ctx: dict[str, Any], batch_id: str) -> None:
    runner: BatchRunner = ctx["runner"]
    await _run_step(f"expand {batch_id}", runner.expand(batch_id))


async def batch_collect(ctx: dict[str, Any], batch_id: str, seq: int) -> None:
    runner: BatchRunner = ctx["runner"]
    await _run_step(f"collect {batch_id}", runner.collect(batch_id, seq))


class BatchControl:
    """Starts and stops the control worker with the API process."""

    def __init__(self, services: Services, runner: BatchRunner) -> None:
        self.worker = Worker(
            functions=[
                func(batch_expand, name=ControlQueue.EXPAND, max_tries=1000),
                func(batch_collect, name=ControlQueue.COLLECT, max_tries=1000),
            ],
            queue_name=services.keys.batch_control_queue,
            redis_pool=services.redis,
            max_jobs=4,
            job_timeout=JOB_TIMEOUT_S,
            keep_result=int(LEASE_S * 4),  # dedups re-enqueues of a finished step meanwhile
            poll_delay=0.2,
            handle_signals=False,
            job_serializer=serialize_job,
            job_deserializer=deserialize_job,
            ctx={"runner": runner},
            log_results=False,
        )
        self.worker.in_progress_timeout_s = LEASE_S
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="batch-control")

    async def _run(self) -> None:
        while True:  # the poll loop survives Redis outages
            try:
                await self.worker.main()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("batch control poll failed (%r); restarting", exc)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        """Stop polling; steps in flight get a moment, then their lease brings them back."""
        self.worker.allow_pick_jobs = False
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        tasks = [t for t in self.worker.tasks.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=5)
            for task in tasks:
                task.cancel()

"""The engine watchdog: a step running longer than `LLM_ENGINE_STALL_S` while the worker has
work means the engine thread is stuck (a hung kernel, a deadlock). The worker then reports
itself `unhealthy` in its heartbeat (the API routes nothing to it), takes no new jobs, and
hands its jobs back to the queue, so other workers run them (as the next attempt). If the
step ever ends, the worker is healthy again; the aborts it queued free the old jobs' blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from shared.background import BackgroundTask
from worker.engine_thread import EngineThread

logger = logging.getLogger(__name__)


class StallWatchdog(BackgroundTask):
    task_name = "engine-watchdog"

    def __init__(
        self,
        engine_thread: EngineThread,
        stall_s: float,
        hand_back: Callable[[], list[str]],
    ) -> None:
        self.engine_thread = engine_thread
        self.stall_s = stall_s
        self._hand_back = hand_back
        self.is_stalled = False

    def check(self) -> None:
        """Act on a change: stalled -> hand the jobs back; a step ended -> healthy again."""
        stalled_for = self.engine_thread.stalled_for()
        if not self.is_stalled and stalled_for > self.stall_s:
            self.is_stalled = True
            job_ids = self._hand_back()
            logger.error(
                "engine step running for %.1f s (LLM_ENGINE_STALL_S=%.1f): worker unhealthy; "
                "handed %d job(s) back to the queue",
                stalled_for,
                self.stall_s,
                len(job_ids),
            )
        elif self.is_stalled and stalled_for == 0.0:
            self.is_stalled = False
            logger.warning("engine stepping again: worker healthy")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.stall_s / 4))
            self.check()

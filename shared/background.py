"""One asyncio task a component runs beside its event loop: started once, cancelled at stop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class BackgroundTask:
    """Subclasses define `_run` (an endless loop) and name the task `task_name`."""

    task_name = "background"
    _task: asyncio.Task[Any] | None = None

    def _run(self) -> Coroutine[Any, Any, None]:
        raise NotImplementedError

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

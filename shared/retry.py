"""One retry-with-backoff helper for every reconnect loop (Redis going away and coming back).

Each call states its semantics: which errors it retries (`on`), and whether it gives up
(`give_up_after_s`, the error is raised) or retries forever (`FOREVER`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
FOREVER: float | None = None


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff: wait `first_s`, then twice as long each time, up to `max_s`."""

    first_s: float
    max_s: float
    factor: float = 2.0


async def retry(
    op: Callable[[], Awaitable[T]],
    *,
    on: tuple[type[BaseException], ...],
    what: str,
    backoff: Backoff,
    give_up_after_s: float | None,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """Run `op` until it returns, waiting with `backoff` after each error of a type in `on`.

    Gives up (raises the last error) when the next wait would end past `give_up_after_s`
    from the first try; `FOREVER` never gives up. Other errors propagate at once. Each retry
    is logged, or reported to `on_error` instead where the caller tracks outages itself.
    """
    deadline = None if give_up_after_s is None else time.monotonic() + give_up_after_s
    delay = backoff.first_s
    while True:
        try:
            return await op()
        except on as exc:
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            if on_error is not None:
                on_error(exc)
            else:
                logger.warning("%s failed (%r); retrying in %.2f s", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * backoff.factor, backoff.max_s)

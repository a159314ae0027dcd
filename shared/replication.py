"""Writes that must outlive a failover wait for a replica (Redis WAIT), when there is one.

A Redis primary acknowledges a write before its replicas have it. If it dies in between
(SIGKILL, a lost machine) and Sentinel promotes a replica, that write never happened. `WAIT 1`
on the connection that wrote closes the window: it returns once a replica has every write the
connection made. Ladle waits after the writes that accept a job and after each batch of stream
events; a primary without a connected replica (a plain Redis, or one whose replica is down)
skips the wait, so it costs nothing where there is nothing to wait for (docs/reliability.md,
"Redis failover").
"""

from __future__ import annotations

import logging
import time

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)
# How long a write waits for a replica before it counts as not replicated.
WAIT_TIMEOUT_MS = 1000
# How often the primary's replica count is looked up again (INFO replication).
REFRESH_S = 1.0


class NotReplicated(Exception):
    """A replica was connected but did not confirm the writes within the timeout."""


class ReplicaWaiter:
    """Knows whether the primary has a replica, and adds and checks the WAIT for it."""

    def __init__(
        self,
        redis: Redis,
        timeout_ms: int = WAIT_TIMEOUT_MS,
        refresh_s: float = REFRESH_S,
        is_enabled: bool = True,
    ) -> None:
        self.redis = redis
        self.is_enabled = is_enabled  # off for a cluster: its pipelines span several primaries
        self.timeout_ms = timeout_ms
        self.refresh_s = refresh_s
        self._num_replicas = 0
        self._checked_at = float("-inf")
        self.num_shortfalls = 0  # waits that timed out (a lagging or vanished replica)

    async def num_required(self) -> int:
        """1 while the primary reports a connected replica, else 0 (cached `refresh_s`)."""
        if not self.is_enabled:
            return 0
        if time.monotonic() - self._checked_at >= self.refresh_s:
            try:
                info = await self.redis.info("replication")
            except ResponseError:  # a server without INFO replication has no replicas
                info = {}
            self._num_replicas = int(info.get("connected_slaves", 0))
            self._checked_at = time.monotonic()
        return min(self._num_replicas, 1)

    def add_wait(self, pipe: Pipeline, num_required: int) -> None:
        """Queue WAIT as the pipeline's last command (it covers the pipeline's writes)."""
        if num_required:
            pipe.wait(num_required, self.timeout_ms)

    def check(self, results: list, num_required: int) -> None:
        """Raise NotReplicated if the pipeline's WAIT came back short."""
        if num_required and int(results[-1]) < num_required:
            self.num_shortfalls += 1
            self._checked_at = float("-inf")  # the replica may be gone: look again next time
            raise NotReplicated(
                f"no replica confirmed the write within {self.timeout_ms} ms "
                f"({results[-1]} of {num_required})"
            )

"""Redis key names, in one place, all under the configured prefix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "ladle"

    @property
    def queue(self) -> str:
        """The arq queue (a sorted set of job ids)."""
        return f"{self.prefix}:queue"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat time."""
        return f"{self.prefix}:workers"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel carrying job ids to abort."""
        return f"{self.prefix}:cancel"

    @property
    def wake_channel(self) -> str:
        """Pub/sub channel the API pings after enqueueing, so idle workers poll at once."""
        return f"{self.prefix}:wake"

    @property
    def supervisors(self) -> str:
        """Sorted set: `ladle up` supervisor id -> last update time."""
        return f"{self.prefix}:supervisors"

    def supervisor(self, supervisor_id: str) -> str:
        return f"{self.prefix}:supervisor:{supervisor_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def payload(self, job_id: str) -> str:
        return f"{self.prefix}:payload:{job_id}"

    def stream(self, job_id: str) -> str:
        return f"{self.prefix}:stream:{job_id}"

    def cancelled(self, job_id: str) -> str:
        """Set when a job is cancelled, so a worker picking it up later skips it."""
        return f"{self.prefix}:cancelled:{job_id}"

    def key_jobs(self, api_key_id: str) -> str:
        """Set of a key's unfinished job ids (per-key concurrency limit)."""
        return f"{self.prefix}:keyjobs:{api_key_id}"

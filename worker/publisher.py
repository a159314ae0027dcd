"""The publisher owns engine outputs -> stream events: one Redis pipeline per batch of steps."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared.replication import NotReplicated, ReplicaWaiter
from shared.retry import FOREVER, Backoff, retry
from shared.tokenizer import Tokenizer
from worker.engine.engine import SequenceOutput
from worker.job_state import JobState, job_for
from worker.job_writer import JobWriter
from worker.metrics import WorkerMetricsRecorder

logger = logging.getLogger(__name__)
PUBLISH_BACKOFF = Backoff(first_s=0.05, max_s=2.0)


class Publisher:
    """Takes each engine step's outputs from the engine thread and writes their events.

    Steps that arrive while Redis is slow are coalesced into one pipeline; a job whose last
    event is written is reported to `on_finished`.
    """

    def __init__(
        self,
        redis: Redis,
        store: JobWriter,
        jobs: dict[str, JobState],
        tokenizer: Tokenizer,
        on_finished: Callable[[JobState], None],
        metrics: WorkerMetricsRecorder | None = None,
    ) -> None:
        self.redis = redis
        self.store = store
        self.jobs = jobs  # the lifecycle's running jobs, by id (read only here)
        self.tokenizer = tokenizer  # event-loop thread only; the engine has its own
        self.on_finished = on_finished
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        in_cluster = store.shards.cluster is not None
        self.replicas = [
            ReplicaWaiter(client, is_enabled=not in_cluster) for client in store.shards.clients
        ]
        self._outputs: asyncio.Queue[list[SequenceOutput]] = asyncio.Queue()

    def on_outputs(self, outputs: list[SequenceOutput]) -> None:
        """Called on the engine thread after each step."""
        self.loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)

    async def run(self) -> None:
        """Publish forever, several steps at once when Redis lags."""
        while True:
            batches = [await self._outputs.get()]
            while not self._outputs.empty():
                batches.append(self._outputs.get_nowait())
            finished = await self._publish(batches)
            if self.metrics:
                self.metrics.observe_steps(batches)
            for job in finished:
                self.on_finished(job)

    async def _publish(self, batches: list[list[SequenceOutput]]) -> list[JobState]:
        finished: list[JobState] = []
        entries: list[tuple[str, object]] = []
        for outputs in batches:
            for output in outputs:
                job = job_for(self.jobs, output.request_id)
                if job is None or job.outcome.done():  # ended, or an earlier attempt's
                    continue
                previous_token_at = job.last_token_at
                event = job.apply(output, self.tokenizer)
                if event is not None:  # a vector or score waits for the job's `done`
                    entries.append((job.payload.id, event))
                    if self.metrics:
                        self.metrics.observe_token(job, previous_token_at)
                if job.is_finished:
                    finished.append(job)
        await self._write_events(entries)
        return finished

    async def _write_events(self, entries: list[tuple[str, object]]) -> None:
        """Redis blinking must not drop tokens: retried until written, however long."""
        by_shard: dict[int, list[tuple[str, object]]] = {}
        for job_id, event in entries:
            shard = self.store.shards.index(self.store.keys.stream(job_id))
            by_shard.setdefault(shard, []).append((job_id, event))
        if len(by_shard) == 1:  # the usual case: no task for gather to wrap it in
            await self._write_shard(*by_shard.popitem())
        else:
            await asyncio.gather(*(self._write_shard(i, part) for i, part in by_shard.items()))

    async def _write_shard(self, shard: int, entries: list[tuple[str, object]]) -> None:
        """One pipeline to one stream shard (the main Redis unless streams are sharded)."""
        client, replicas = self.store.shards.clients[shard], self.replicas[shard]

        async def write() -> None:
            num_required = await replicas.num_required()
            pipe = client.pipeline(transaction=False)
            for job_id, event in entries:
                self.store.append(pipe, job_id, event)
            replicas.add_wait(pipe, num_required)
            results = await pipe.execute()
            try:
                replicas.check(results, num_required)
            except NotReplicated as exc:  # tokens are not held up for a lagging replica
                logger.warning("stream events not confirmed by a replica: %s", exc)

        await retry(
            write,
            on=(ConnectionError, RedisError),
            what="publishing events",
            backoff=PUBLISH_BACKOFF,
            give_up_after_s=FOREVER,
        )

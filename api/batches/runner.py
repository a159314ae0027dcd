"""Running a batch: validate and expand it into line jobs, collect finished lines, stop the
rest on cancel or expiry, and finalise into output and error files.

Each step is arq work on the batch control queue (`api/batches/control.py`) that any API
process runs, and each is safe to run twice, or at once in two processes: line job ids are
derived from the batch id and line number, a line's result is recorded once (HSETNX), the
record changes under WATCH, and output files have derived ids. A process killed anywhere
leaves work that the next run of the same step (arq retries it when its lease runs out, or
the next link of the collection chain, already queued) picks up where the record says.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from api.batches.contracts import BatchError, BatchErrors, BatchRecord, FileRecord, line_job_id
from api.batches.contracts import output_file_id as derived_file_id
from api.batches.files import BatchLine, FileStore, parse_batch_file
from api.batches.lines import LineResults, finished_entry, request_entry, stopped_entry, submit_line
from api.batches.store import RECORD_GRACE_S, BatchStore
from api.errors import APIError
from api.services import Services
from shared.contracts import FINAL_STATUSES, JobRecord

log = logging.getLogger(__name__)
EXPAND_CHUNK = 250  # lines submitted per expansion job (each job stays short)
COLLECT_CHUNK = 500  # job records read per MGET
LOCK_S = 20  # a collection pass holds the batch's lock at most this long (a dead one too)


class ControlQueue:
    """Enqueues the batch control work; ids are derived, so enqueueing twice is a no-op."""

    EXPAND = "batch_expand"
    COLLECT = "batch_collect"

    def __init__(self, services: Services) -> None:
        self.redis = services.redis
        self.queue = services.keys.batch_control_queue
        self.poll_s = services.settings.batch_poll_s

    async def expand(self, batch_id: str, start: int) -> None:
        job_id = f"{batch_id}:expand:{start}"
        await self.redis.enqueue_job(self.EXPAND, batch_id, _job_id=job_id, _queue_name=self.queue)

    async def collect(self, batch_id: str, seq: int, *, soon: bool = False) -> None:
        defer = None if soon else self.poll_s
        await self.redis.enqueue_job(
            self.COLLECT,
            batch_id,
            seq,
            _job_id=f"{batch_id}:collect:{seq}",
            _queue_name=self.queue,
            _defer_by=defer,
        )

    async def ensure(self, batch: BatchRecord) -> None:
        """Make sure the batch's next step is queued (after a loss of Redis data, or a
        process that died between writing the record and enqueueing)."""
        if batch.is_final:
            return
        if batch.status == "validating" or batch.num_expanded < batch.request_counts.total:
            await self.expand(batch.id, batch.num_expanded)
        await self.collect(batch.id, batch.collect_seq)


def stop_code(batch: BatchRecord, now: float) -> str | None:
    """Why the batch's unfinished lines must stop, if they must."""
    if batch.status == "cancelling":
        return "batch_cancelled"
    if batch.status == "in_progress" and batch.expires_at and now >= batch.expires_at:
        return "batch_expired"
    return None


def _change(**fields: object) -> Callable[[BatchRecord], bool]:
    def apply(record: BatchRecord) -> bool:
        for name, value in fields.items():
            setattr(record, name, value)
        return True

    return apply


class BatchRunner:
    def __init__(self, services: Services, batches: BatchStore, files: FileStore) -> None:
        self.services = services
        self.batches = batches
        self.files = files
        self.results = LineResults(services, RECORD_GRACE_S)
        self.queue = ControlQueue(services)

    # ---- expansion -----------------------------------------------------------------------

    async def expand(self, batch_id: str) -> None:
        """Validate the batch (first run), then submit the next chunk of its lines."""
        batch = await self.batches.get(batch_id)
        if batch is not None and batch.status == "validating":
            batch = await self._validate(batch)
        if batch is None or batch.is_final:
            return
        total = batch.request_counts.total
        if batch.status == "in_progress" and batch.num_expanded < total:
            batch = await self._expand_chunk(batch)
            if batch.status == "in_progress" and batch.num_expanded < total:
                await self.queue.expand(batch.id, batch.num_expanded)
                return
        await self.queue.collect(batch.id, batch.collect_seq, soon=True)

    async def _lines(self, batch: BatchRecord) -> list[BatchLine]:
        content = await self.files.content(batch.input_file_id, batch.owner)
        return parse_batch_file(content, self.services.settings.batch_max_lines)

    async def _validate(self, batch: BatchRecord) -> BatchRecord | None:
        """validating -> in_progress (lines counted, custom_ids kept), or failed."""
        try:
            lines = await self._lines(batch)
        except APIError as exc:
            if exc.status >= 500:
                raise
            error = BatchError(code=exc.code or "invalid_file", message=exc.message)
            return await self._fail(batch, [error])
        # Unlike OpenAI, a line's own url decides its endpoint: one batch may mix chat and
        # text completions (the batch's `endpoint` is kept as given).
        ids_key = self.services.keys.batch_custom_ids(batch.id)
        async with self.services.redis.pipeline(transaction=True) as pipe:
            pipe.delete(ids_key)
            pipe.rpush(ids_key, *[line.custom_id for line in lines])
            pipe.expire(ids_key, RECORD_GRACE_S)
            await pipe.execute()

        def start(record: BatchRecord) -> bool:
            if record.status != "validating":
                return False
            record.status, record.in_progress_at = "in_progress", int(time.time())
            record.request_counts.total = len(lines)
            return True

        return await self.batches.update(batch.id, start)

    async def _fail(self, batch: BatchRecord, errors: list[BatchError]) -> BatchRecord | None:
        return await self.batches.update(
            batch.id,
            _change(status="failed", failed_at=int(time.time()), errors=BatchErrors(data=errors)),
        )

    async def _expand_chunk(self, batch: BatchRecord) -> BatchRecord:
        start = batch.num_expanded
        end = min(start + EXPAND_CHUNK, batch.request_counts.total)
        try:
            lines = (await self._lines(batch))[start:end]
        except APIError as exc:  # the input file was deleted (or expired) meanwhile
            if exc.status >= 500:
                raise
            await self._record_missing_file(batch, start, end)
        else:
            for line in lines:
                await submit_line(self.services, self.results, batch, line)

        def advance(record: BatchRecord) -> bool:
            record.num_expanded = max(record.num_expanded, end)
            return True

        return await self.batches.update(batch.id, advance) or batch

    async def _record_missing_file(self, batch: BatchRecord, start: int, end: int) -> None:
        body = APIError(404, "The batch's input file was deleted before this line ran").body()
        for line in range(start, end):
            entry = request_entry(line_job_id(batch.id, line), 404, body)
            await self.results.record(batch.id, line, "err", entry)

    # ---- collection ----------------------------------------------------------------------

    async def collect(self, batch_id: str, seq: int) -> None:
        """One link of the collection chain: queue the next link first (so a process killed
        mid-pass does not end the chain), then collect, stop or finalise."""
        batch = await self.batches.get(batch_id)
        if batch is None or batch.is_final:
            return
        if seq < batch.collect_seq:  # a retried old link: just make sure the chain lives
            await self.queue.collect(batch_id, batch.collect_seq)
            return
        batch = await self.batches.update(batch_id, _change(collect_seq=seq + 1))
        if batch is None or batch.is_final:
            return
        await self.queue.collect(batch_id, seq + 1)
        lock = self.services.keys.batch_lock(batch_id)
        if not await self.services.redis.set(lock, seq, ex=LOCK_S, nx=True):
            return  # another process is mid-pass on this batch; the next link comes soon
        try:
            await self._pass(batch)
        finally:
            await self.services.redis.delete(lock)

    async def _pass(self, batch: BatchRecord) -> None:
        if batch.status == "validating":
            return
        code = stop_code(batch, time.time())
        if code is not None and not batch.lines_stopped:
            batch = await self._stop_lines(batch, code)
        await self._collect_finished(batch, code)
        ok, err = await self.results.counts(batch.id)

        def count(record: BatchRecord) -> bool:
            record.request_counts.completed, record.request_counts.failed = ok, err
            return True

        batch = await self.batches.update(batch.id, count) or batch
        total = batch.request_counts.total
        expanded = batch.num_expanded >= total or batch.lines_stopped
        if not batch.is_final and expanded and ok + err >= total:
            await self._finalize(batch, code)

    async def _stop_lines(self, batch: BatchRecord, code: str) -> BatchRecord:
        """Cancel the queued lines (running ones finish) and record lines never submitted."""
        done = await self.results.done_lines(batch.id)
        for line in range(batch.num_expanded):
            if line not in done:
                await self.services.jobs.cancel_queued(line_job_id(batch.id, line))
        for line in range(batch.num_expanded, batch.request_counts.total):
            job_id = line_job_id(batch.id, line)
            await self.results.record(batch.id, line, "err", stopped_entry(job_id, code))
        return await self.batches.update(batch.id, _change(lines_stopped=True)) or batch

    async def _collect_finished(self, batch: BatchRecord, code: str | None) -> None:
        done = await self.results.done_lines(batch.id)
        pending = [line for line in range(batch.num_expanded) if line not in done]
        lost: list[int] = []
        for start in range(0, len(pending), COLLECT_CHUNK):
            chunk = pending[start : start + COLLECT_CHUNK]
            keys = [self.services.keys.job(line_job_id(batch.id, line)) for line in chunk]
            for line, raw in zip(chunk, await self.services.redis.mget(keys), strict=True):
                if raw is None:
                    lost.append(line)
                    continue
                record = JobRecord.model_validate_json(raw)
                if record.status in FINAL_STATUSES:
                    await self._record_finished(batch, line, record, code)
        if lost:
            await self._resubmit(batch, lost)

    async def _record_finished(
        self, batch: BatchRecord, line: int, record: JobRecord, code: str | None
    ) -> None:
        kind, entry = await finished_entry(self.services, record, code or "batch_cancelled")
        if await self.results.record(batch.id, line, kind, entry) and record.started_at:
            wait = max(0.0, record.started_at - record.created_at)
            self.services.metrics.lane_wait.labels(lane="batch").observe(wait)

    async def _resubmit(self, batch: BatchRecord, lines: list[int]) -> None:
        """Lines whose job record is gone (Redis lost data): submit them again (same ids)."""
        log.warning("batch %s: %d line records missing; resubmitting", batch.id, len(lines))
        by_index = {line.index: line for line in await self._lines(batch)}
        for index in lines:
            await submit_line(self.services, self.results, batch, by_index[index])

    # ---- finalisation --------------------------------------------------------------------

    async def _finalize(self, batch: BatchRecord, code: str | None) -> None:
        """Write the output and error files (derived ids), then the final status."""
        if code is None:
            await self.batches.update(
                batch.id, _change(status="finalizing", finalizing_at=int(time.time()))
            )
        file_ids = await self._write_files(batch)
        ok, err = await self.results.counts(batch.id)
        status = {"batch_cancelled": "cancelled", "batch_expired": "expired"}.get(code or "")
        status = status or "completed"
        now = int(time.time())
        await self.batches.update(
            batch.id,
            _change(
                status=status,
                **{f"{status}_at": now},
                output_file_id=file_ids.get("ok"),
                error_file_id=file_ids.get("err"),
            ),
        )
        keys = self.services.keys
        await self.services.redis.delete(
            keys.batch_results(batch.id), keys.batch_custom_ids(batch.id)
        )
        log.info("batch %s %s: %d ok, %d errors", batch.id, status, ok, err)

    async def _write_files(self, batch: BatchRecord) -> dict[str, str]:
        raw_ids = await self.services.redis.lrange(
            self.services.keys.batch_custom_ids(batch.id), 0, -1
        )
        custom_ids = [c.decode() if isinstance(c, bytes) else c for c in raw_ids]
        lines: dict[str, list[str]] = {"ok": [], "err": []}
        for index, result in sorted((await self.results.all(batch.id)).items()):
            entry = result["line"]
            ordered = {"id": entry["id"], "custom_id": custom_ids[index], **entry}
            lines[result["kind"]].append(json.dumps(ordered, separators=(",", ":")))
        file_ids: dict[str, str] = {}
        for kind, content in lines.items():
            if not content:
                continue
            file_id = derived_file_id(batch.id, kind)
            name = f"{batch.id}_{'output' if kind == 'ok' else 'error'}.jsonl"
            record = FileRecord(
                id=file_id, bytes=0, filename=name, purpose="batch_output", owner=batch.owner
            )
            await self.files.put(record, ("\n".join(content) + "\n").encode(), only_new=True)
            file_ids[kind] = file_id
        return file_ids

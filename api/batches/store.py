"""Batch records in Redis: create, read, list, and read-modify-write under WATCH.

Several writers touch one record (the cancel route, the expander, the collector, on any API
process), so every change goes through `update`, an optimistic transaction retried on
conflict; a final record is never changed again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis
from redis.exceptions import WatchError

from api.batches.contracts import BatchRecord, stored_json
from api.batches.files import page_ids
from api.errors import APIError
from shared.keys import Keys

# Records outlive their batch's window by this long, so results stay findable.
RECORD_GRACE_S = 30 * 86_400


def batch_not_found(batch_id: str) -> APIError:
    return APIError(
        404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found"
    )


class BatchStore:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def create(self, record: BatchRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.batch(record.id), stored_json(record), ex=RECORD_GRACE_S, nx=True)
            pipe.zadd(self.keys.batches(record.owner), {record.id: time.time()})
            pipe.expire(self.keys.batches(record.owner), RECORD_GRACE_S)
            await pipe.execute()

    async def get(self, batch_id: str) -> BatchRecord | None:
        raw = await self.redis.get(self.keys.batch(batch_id))
        return BatchRecord.model_validate_json(raw) if raw else None

    async def get_owned(self, batch_id: str, owner: str) -> BatchRecord:
        record = await self.get(batch_id)
        if record is None or record.owner != owner:
            raise batch_not_found(batch_id)
        return record

    async def update(
        self, batch_id: str, change: Callable[[BatchRecord], bool]
    ) -> BatchRecord | None:
        """Apply `change` (which returns whether it changed anything) atomically; None if
        the record is gone. A final record is returned unchanged."""
        key = self.keys.batch(batch_id)
        while True:
            async with self.redis.pipeline(transaction=True) as pipe:
                try:
                    await pipe.watch(key)
                    raw = await pipe.get(key)
                    if raw is None:
                        return None
                    record = BatchRecord.model_validate_json(raw)
                    if record.is_final or not change(record):
                        return record
                    pipe.multi()
                    pipe.set(key, stored_json(record), ex=RECORD_GRACE_S)
                    await pipe.execute()
                    return record
                except WatchError:
                    continue

    async def list(
        self, owner: str, after: str | None, limit: int
    ) -> tuple[list[BatchRecord], bool]:
        """Newest first after the cursor `after`: up to `limit` records, and has_more."""
        ids = await page_ids(self.redis, self.keys.batches(owner), after, limit + 1)
        raws = await self.redis.mget([self.keys.batch(i) for i in ids]) if ids else []
        records = [BatchRecord.model_validate_json(raw) for raw in raws if raw]
        return records[:limit], len(ids) > limit

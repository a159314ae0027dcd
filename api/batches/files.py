"""Files for the Batch API: JSONL validation and the store every API process reads.

Files live in Redis (one hash per file: `meta` and `content`), expiring after
`LLM_FILE_TTL_S`. `FileStore` is the whole interface the routes and the batch runner use;
DESIGN.md says how to put the bytes elsewhere.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from api.batches.contracts import BATCH_ENDPOINTS, FileRecord
from api.errors import APIError
from shared.keys import Keys


@dataclass
class BatchLine:
    """One request of a batch input file (0-based `index`)."""

    index: int
    custom_id: str
    url: str
    body: dict[str, Any]


def _line_error(number: int, message: str) -> APIError:
    return APIError(400, f"Line {number}: {message}", param="file", code="invalid_batch_line")


def parse_line(index: int, raw: bytes) -> BatchLine:
    """One JSONL line as OpenAI's batch input: custom_id, method POST, url, body."""
    number = index + 1
    try:
        item = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise _line_error(number, f"not valid JSON ({exc})") from exc
    if not isinstance(item, dict):
        raise _line_error(number, "must be a JSON object")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise _line_error(number, "custom_id must be a non-empty string")
    if item.get("method") != "POST":
        raise _line_error(number, 'method must be "POST"')
    url = item.get("url")
    if url not in BATCH_ENDPOINTS:
        raise _line_error(number, f"url must be one of {', '.join(BATCH_ENDPOINTS)}")
    if not isinstance(item.get("body"), dict):
        raise _line_error(number, "body must be a JSON object")
    return BatchLine(index, custom_id, url, item["body"])


def split_lines(content: bytes) -> list[bytes]:
    """The file's lines; one final newline is allowed, other empty lines are not."""
    lines = content.split(b"\n")
    if lines and lines[-1].strip() == b"":
        lines.pop()
    return lines


def parse_batch_file(content: bytes, max_lines: int) -> list[BatchLine]:
    """Every line parsed, or a 400 naming the first bad line (1-based)."""
    raw_lines = split_lines(content)
    if not raw_lines:
        raise APIError(400, "The file has no lines", param="file", code="invalid_batch_file")
    if len(raw_lines) > max_lines:
        raise APIError(
            400,
            f"The file has {len(raw_lines)} lines; a batch may have at most {max_lines}",
            param="file",
            code="too_many_lines",
        )
    lines, seen = [], set()
    for index, raw in enumerate(raw_lines):
        line = parse_line(index, raw)
        if line.custom_id in seen:
            raise _line_error(index + 1, f"custom_id {line.custom_id!r} is used twice")
        seen.add(line.custom_id)
        lines.append(line)
    return lines


class FileStore:
    """Create, read, list and delete files (Redis hashes with a TTL)."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s

    async def put(self, record: FileRecord, content: bytes, *, only_new: bool = False) -> bool:
        """Store a file. With `only_new`, a file of that id already there is kept (False)."""
        record.bytes = len(content)
        record.expires_at = record.created_at + self.ttl_s
        key = self.keys.file(record.id)
        if only_new and await self.redis.exists(key):
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"meta": record.model_dump_json(), "content": content})
            pipe.expire(key, self.ttl_s)
            pipe.hset(key, "owner", record.owner)
            pipe.zadd(self.keys.files(record.owner), {record.id: time.time()})
            pipe.expire(self.keys.files(record.owner), self.ttl_s)
            await pipe.execute()
        return True

    async def get(self, file_id: str, owner: str) -> FileRecord:
        """The file's record; 404 when it does not exist or belongs to another owner."""
        meta, stored_owner = await self.redis.hmget(self.keys.file(file_id), ["meta", "owner"])
        if meta is None or _text(stored_owner) != owner:
            raise APIError(
                404, f"No such File object: {file_id}", param="file_id", code="file_not_found"
            )
        return FileRecord.model_validate_json(meta).model_copy(update={"owner": owner})

    async def content(self, file_id: str, owner: str) -> bytes:
        await self.get(file_id, owner)
        data = await self.redis.hget(self.keys.file(file_id), "content")
        if data is None:  # expired between the two reads
            raise APIError(404, f"No such File object: {file_id}", code="file_not_found")
        return bytes(data)

    async def list(
        self, owner: str, after: str | None, limit: int
    ) -> tuple[list[FileRecord], bool]:
        """Newest first, after the file `after` (a cursor): up to `limit`, and has_more."""
        index_key = self.keys.files(owner)
        ids = await page_ids(self.redis, index_key, after, limit + 1)
        metas = await self._metas(ids)
        gone = [file_id for file_id, meta in zip(ids, metas, strict=True) if meta is None]
        if gone:  # expired files leave their index entry behind
            await self.redis.zrem(index_key, *gone)
        records = [FileRecord.model_validate_json(m) for m in metas if m is not None]
        return records[:limit], len(ids) > limit

    async def _metas(self, ids: list[str]) -> list[bytes | None]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hget(self.keys.file(file_id), "meta")
            return await pipe.execute()

    async def delete(self, file_id: str, owner: str) -> None:
        await self.get(file_id, owner)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.file(file_id))
            pipe.zrem(self.keys.files(owner), file_id)
            await pipe.execute()


async def page_ids(redis: Redis, index_key: str, after: str | None, limit: int) -> list[str]:
    """Ids from a creation-time sorted set, newest first, starting after `after`."""
    start = 0
    if after:
        rank = await redis.zrevrank(index_key, after)
        if rank is None:
            raise APIError(400, f"No object with id {after!r} to list after", param="after")
        start = rank + 1
    ids = await redis.zrevrange(index_key, start, start + limit - 1)
    return [_text(i) for i in ids]


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def list_object(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """OpenAI's cursor page."""
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }

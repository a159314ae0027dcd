"""`Idempotency-Key` on submissions: the same key with the same body gives back the first
object; with a different body, 409. Claims live in Redis (`{p}:idem:{scope}:{hash}`), so every
API process sees them, for as long as the object they name exists.

The flow for any submission (jobs here; batches use the same three calls):

    key = idempotency_key(request)                 # None without the header
    claim = await store.claim(scope, key, fingerprint(raw_body), new_id, exists)
    if claim.existing_id: ... answer with that object (replayed) ...
    try: ... create the object with `new_id` ...
    except BaseException: await store.release(claim); raise
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from redis.asyncio import Redis

from api.errors import APIError
from shared.keys import Keys

HEADER = "Idempotency-Key"
_VALID = re.compile(r"^[\x21-\x7e]{1,255}$")
# A claim whose object never appeared (its API process died between claim and create) may be
# taken over after this long; before that a concurrent duplicate waits for the object.
STALE_CLAIM_S = 10.0
_WAIT_S = 5.0

# Set the claim if absent; else return what is there.
_CLAIM = """
local current = redis.call('GET', KEYS[1])
if current then return current end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return false
"""
# Replace (take over) or delete a claim only if it is still the one we saw.
_SWAP = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[1])
else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end
return 1
"""


def idempotency_key(request: Request) -> str | None:
    """The request's `Idempotency-Key`, or None; 400 for an empty or odd one."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not _VALID.match(key):
        raise APIError(
            400,
            f"{HEADER} must be 1 to 255 visible ASCII characters",
            param=HEADER,
            code="invalid_idempotency_key",
        )
    return key


def fingerprint(raw_body: bytes) -> str:
    """The body's identity: JSON compared by value (key order and spacing do not matter)."""
    try:
        canonical = json.dumps(json.loads(raw_body), sort_keys=True, separators=(",", ":"))
    except ValueError:
        canonical = raw_body.decode("utf-8", "replace")
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Claim:
    redis_key: str
    value: str
    existing_id: str | None = None  # set: replay this object instead of creating one


class IdempotencyStore:
    def __init__(self, redis: Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._claim = redis.register_script(_CLAIM)
        self._swap = redis.register_script(_SWAP)

    async def claim(
        self,
        scope: str,
        key: str,
        body_fingerprint: str,
        new_id: str,
        exists: Callable[[str], Awaitable[bool]],
    ) -> Claim:
        """Claim `key` for `new_id`, or the earlier object's id to replay; 409 for another
        body, or while a concurrent duplicate's object has not appeared yet."""
        redis_key = self.keys.idempotency(scope, hashlib.sha256(key.encode()).hexdigest()[:32])
        mine = json.dumps({"id": new_id, "body": body_fingerprint, "at": time.time()})
        deadline = time.monotonic() + _WAIT_S
        while True:
            raw = await self._claim(keys=[redis_key], args=[mine, self.ttl_s])
            if raw is None:
                return Claim(redis_key, mine)
            current = json.loads(raw)
            if current["body"] != body_fingerprint:
                raise _reused(key)
            if await exists(current["id"]):
                return Claim(redis_key, raw, existing_id=current["id"])
            if time.time() - current["at"] > STALE_CLAIM_S:  # its object never came, or expired
                if await self._swap(keys=[redis_key], args=[raw, mine, self.ttl_s]):
                    return Claim(redis_key, mine)
            elif time.monotonic() > deadline:
                raise _in_use(key)
            await asyncio.sleep(0.05)

    async def release(self, claim: Claim) -> None:
        """Drop a claim whose object was not created (refused, failed): the key may be
        used again."""
        if claim.existing_id is None:
            await self._swap(keys=[claim.redis_key], args=[claim.value, "", 0])


def _reused(key: str) -> APIError:
    return APIError(
        409,
        f"{HEADER} '{key}' was already used with a different request body",
        param=HEADER,
        code="idempotency_key_reused",
    )


def _in_use(key: str) -> APIError:
    return APIError(
        409,
        f"A request with {HEADER} '{key}' is still being processed; retry shortly",
        param=HEADER,
        code="idempotency_key_in_use",
        headers={"Retry-After": "1"},
    )

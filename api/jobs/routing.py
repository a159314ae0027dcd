"""Cache-aware routing: a request goes to the worker whose prefix cache holds the longest
prefix of its prompt, when that worker has room.

Each worker publishes a Bloom filter of its cached blocks' chained hashes
(`PrefixFingerprint`, `shared/prefixes.py`). The API hashes the prompt's full blocks the same
way and counts, per worker of the model, how many leading blocks its filter holds. A request
that one worker holds more of than the others is held for it: `Keys.routed` names the worker
for `LLM_PREFIX_ROUTING_HOLD_MS` (the key's expiry), and the other workers leave the job in
the queue until then. If that worker is busy or gone, the hold ends and any worker takes the
job like any other: routing delays a job by at most the hold, never loses it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import ValidationError
from redis.asyncio import Redis

from api.jobs.workers import WorkerDirectory
from shared.contracts import JobPayload, PrefixFingerprint
from shared.keys import Keys
from shared.prefixes import PrefixFilter, prompt_block_hashes

log = logging.getLogger(__name__)


def choose_worker(
    prints: Sequence[PrefixFingerprint], token_ids: Sequence[int], num_workers: int
) -> str | None:
    """The worker to route a prompt to, or None: no worker holds more of it than another
    (of `num_workers`, some perhaps without a fingerprint yet), or those that hold most have
    no room (anyone may take it)."""
    if num_workers < 2 or not prints:
        return None
    hashes_by_size: dict[int, list[bytes]] = {}
    hits: dict[str, int] = {}
    for fingerprint in prints:
        size = fingerprint.block_size
        if size not in hashes_by_size:
            hashes_by_size[size] = prompt_block_hashes(token_ids, size)
        hits[fingerprint.worker_id] = _held_tokens(fingerprint, hashes_by_size[size])
    best = max(hits.values())
    fewest = min(hits.values()) if len(hits) >= num_workers else 0
    if best == fewest:
        return None
    holders = [p for p in prints if hits[p.worker_id] == best and p.room > 0]
    if not holders:
        return None
    return max(holders, key=lambda p: p.room).worker_id


def _held_tokens(fingerprint: PrefixFingerprint, hashes: list[bytes]) -> int:
    """Tokens of the prompt's leading full blocks the worker's filter holds."""
    try:
        held = PrefixFilter.decode(fingerprint.num_bits, fingerprint.filter)
    except ValueError:  # a damaged filter: as if it held nothing
        return 0
    return held.leading_hits(hashes) * fingerprint.block_size


class PrefixRouter:
    """Picks the worker for a job from the fingerprints its model's live workers publish."""

    def __init__(self, redis: Redis, keys: Keys, workers: WorkerDirectory, enabled: bool) -> None:
        self.redis = redis
        self.keys = keys
        self.workers = workers
        self.enabled = enabled

    async def pick(self, payload: JobPayload) -> str | None:
        """The worker to hold `payload` for, or None. Only interactive generation is routed
        (a batch line waits anyway)."""
        if not self.enabled or payload.lane != "interactive" or not payload.prompt_token_ids:
            return None
        worker_ids = [
            r.worker_id
            for r in await self.workers.live()
            if r.model == payload.model and r.status == "ready" and r.task == "generate"
        ]
        if len(worker_ids) < 2:
            return None
        # Read fresh, not cached: a worker publishes as each job ends, and the next turn of a
        # conversation arrives right after.
        raws = await self.redis.mget([self.keys.prefixes(i) for i in worker_ids])
        return choose_worker(_parsed(raws), payload.prompt_token_ids, len(worker_ids))


def _parsed(raws: Sequence[bytes | str | None]) -> list[PrefixFingerprint]:
    prints = []
    for raw in raws:
        if raw is None:
            continue
        try:
            prints.append(PrefixFingerprint.model_validate_json(raw))
        except ValidationError as exc:  # another wire version: route without it
            log.warning("unreadable prefix fingerprint", extra={"error": str(exc)})
    return prints

"""Cache-aware routing: a request goes to the worker whose prefix cache holds the longest
prefix of its prompt, when that worker has room and is not much busier than the others.

Each worker publishes a Bloom filter of its cached blocks' chained hashes, its load and its
room (`PrefixFingerprint`, `shared/prefixes.py`), as each job ends and every heartbeat. The
API hashes the prompt's full blocks the same way and counts, per worker of the model, how
many leading blocks its filter holds. Of the workers with room and within
`LLM_PREFIX_ROUTING_MAX_IMBALANCE` sequences of the least busy, the one holding most gets
the job (ties: the least busy), so new conversations spread and later turns follow their
cache. The job is held for it: `Keys.routed` names the worker for
`LLM_PREFIX_ROUTING_HOLD_MS` (the key's expiry), and other workers leave the job in the
queue until then. If that worker is busy or gone, the hold ends and any worker takes the
job like any other: routing delays a job by at most the hold, never loses it.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import ValidationError
from redis.asyncio import Redis

from api.jobs.workers import WorkerDirectory
from shared.contracts import JobPayload, PrefixFingerprint
from shared.keys import Keys
from shared.prefixes import PrefixFilter, prompt_block_hashes

log = logging.getLogger(__name__)
# Routings remembered per worker: longer than a fingerprint's age (a heartbeat, 1 s).
ROUTED_MEMORY_S = 10.0


@dataclass
class Candidate:
    """A worker of the model as the router sees it."""

    worker_id: str
    held_tokens: int  # the prompt's leading tokens its prefix cache holds
    load: int  # sequences running and waiting, and jobs routed to it since it published
    room: int  # jobs it would take now, less those routed to it since it published


def choose_worker(
    candidates: Sequence[Candidate],
    num_workers: int,
    max_imbalance: int,
    rng: random.Random | None = None,
) -> str | None:
    """The worker to hold a job for: of those with room and a load within `max_imbalance`
    of the least loaded (a worker without a fingerprint counts as idle), the one holding most
    of the prompt, then the least loaded, then any. None: nobody fits; anyone may take it."""
    if num_workers < 2 or not candidates:
        return None
    least = min(c.load for c in candidates) if len(candidates) >= num_workers else 0
    fair = [c for c in candidates if c.room > 0 and c.load - least <= max_imbalance]
    if not fair:
        return None
    best = max((c.held_tokens, -c.load) for c in fair)
    ties = [c.worker_id for c in fair if (c.held_tokens, -c.load) == best]
    return (rng or random).choice(ties)


def _held_tokens(fingerprint: PrefixFingerprint, hashes: list[bytes]) -> int:
    """Tokens of the prompt's leading full blocks the worker's filter holds."""
    try:
        held = PrefixFilter.decode(fingerprint.num_bits, fingerprint.filter)
    except ValueError:  # a damaged filter: as if it held nothing
        return 0
    return held.leading_hits(hashes) * fingerprint.block_size


class PrefixRouter:
    """Picks the worker for a job from the fingerprints its model's live workers publish."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        workers: WorkerDirectory,
        enabled: bool,
        max_imbalance: int = 3,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.workers = workers
        self.enabled = enabled
        self.max_imbalance = max_imbalance
        # worker id -> when this process routed jobs to it (a fingerprint does not count them yet)
        self._routed_at: dict[str, list[float]] = {}

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
        candidates = self._candidates(_parsed(raws), payload.prompt_token_ids)
        chosen = choose_worker(candidates, len(worker_ids), self.max_imbalance)
        if chosen is not None:
            self._note_routed(chosen)
        return chosen

    def _candidates(
        self, prints: list[PrefixFingerprint], token_ids: Sequence[int]
    ) -> list[Candidate]:
        hashes_by_size: dict[int, list[bytes]] = {}
        candidates = []
        for p in prints:
            if p.block_size not in hashes_by_size:
                hashes_by_size[p.block_size] = prompt_block_hashes(token_ids, p.block_size)
            since = sum(1 for t in self._routed_at.get(p.worker_id, ()) if t > p.published_at)
            candidates.append(
                Candidate(
                    worker_id=p.worker_id,
                    held_tokens=_held_tokens(p, hashes_by_size[p.block_size]),
                    load=p.running + p.waiting + since,
                    room=p.room - since,
                )
            )
        return candidates

    def _note_routed(self, worker_id: str) -> None:
        now = time.time()
        recent = [t for t in self._routed_at.get(worker_id, ()) if now - t < ROUTED_MEMORY_S]
        self._routed_at[worker_id] = [*recent, now]


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

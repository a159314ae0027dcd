"""Cache-aware routing: the API's prompt hashes agree with the block manager's, the Bloom
filter holds what was put in it, the router picks the worker holding the longest prefix (with
room), and a routed job is held for that worker until the hold ends."""

from __future__ import annotations

import asyncio
import random

import fakeredis
from arq.connections import ArqRedis

from api.jobs.routing import PrefixRouter, choose_worker
from shared.contracts import PrefixFingerprint
from shared.keys import Keys
from shared.prefixes import PrefixFilter, filter_bits_for, prompt_block_hashes
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams

BLOCK = 4


def _computed(manager: BlockManager, request_id: str, token_ids: list[int]) -> None:
    request = Request(request_id, token_ids, SamplingParams(temperature=0.0), max_tokens=1)
    manager.allocate_prefix(request)
    assert manager.allocate_slots(request, len(token_ids))
    manager.cache_full_blocks(request, len(token_ids))


def test_the_api_hashes_prompts_as_the_block_manager_caches_them() -> None:
    manager = BlockManager(num_blocks=16, block_size=BLOCK)
    tokens = list(range(100, 111))  # 2 full blocks and 3 tokens
    _computed(manager, "a", tokens)
    assert set(manager.cached_hashes()) == set(prompt_block_hashes(tokens + [7], BLOCK))
    # The block holding the prompt's last token is never served from the cache.
    assert len(prompt_block_hashes(tokens[:8], BLOCK)) == 1
    assert len(prompt_block_hashes(tokens[:9], BLOCK)) == 2


def test_cached_hashes_are_one_tuple_until_the_cache_changes() -> None:
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    _computed(manager, "a", list(range(9)))
    first = manager.cached_hashes()
    assert manager.cached_hashes() is first
    manager.free("a")
    assert manager.cached_hashes() is first  # freed blocks keep their hashes
    _computed(manager, "b", list(range(50, 66)))  # takes every block: evicts a's
    assert manager.cached_hashes() is not first
    assert not set(first) & set(manager.cached_hashes())


def test_the_filter_holds_what_was_added_and_little_else() -> None:
    rng = random.Random(0)
    held = [rng.randbytes(32) for _ in range(1000)]
    others = [rng.randbytes(32) for _ in range(20_000)]
    built = PrefixFilter.of(held, filter_bits_for(1000))
    copy = PrefixFilter.decode(built.num_bits, built.encode())
    assert all(h in copy for h in held)
    assert sum(h in copy for h in others) < 0.005 * len(others)  # 0.24 % expected
    assert copy.leading_hits(held[:5] + others[:1] + held[5:]) == 5
    assert filter_bits_for(0) == 1024 and filter_bits_for(10**9) == 1 << 20


def test_a_filter_built_at_once_has_the_bits_of_one_added_at_a_time() -> None:
    rng = random.Random(1)
    held = [rng.randbytes(32) for _ in range(3000)]
    one_by_one = PrefixFilter(filter_bits_for(3000))
    for block_hash in held:
        one_by_one.add(block_hash)
    assert PrefixFilter.of(held, one_by_one.num_bits).bits == one_by_one.bits
    assert not any(PrefixFilter.of([], 1024).bits)


def _fingerprint(worker_id: str, token_ids: list[int], **load: int) -> PrefixFingerprint:
    built = PrefixFilter.of(prompt_block_hashes(token_ids, BLOCK), 1024)
    return PrefixFingerprint(
        worker_id=worker_id,
        model="m",
        block_size=BLOCK,
        num_bits=1024,
        filter=built.encode(),
        room=load.get("room", 4),
        running=load.get("running", 0),
        published_at=0.0,
    )


SYSTEM = list(range(1, 9))  # two blocks every worker holds
TURN_1 = SYSTEM + list(range(20, 33))
TURN_2 = TURN_1 + list(range(40, 50))


def _choose(prints: list[PrefixFingerprint], tokens: list[int], num_workers: int = 2) -> str | None:
    router = PrefixRouter(None, Keys("p"), None, enabled=True, max_imbalance=2)  # type: ignore[arg-type]
    return choose_worker(router._candidates(prints, tokens), num_workers, 2, random.Random(0))


def test_a_prompt_goes_to_the_worker_holding_most_of_it() -> None:
    prints = [_fingerprint("a", SYSTEM + [0]), _fingerprint("b", TURN_1 + [0])]
    assert _choose(prints, TURN_2) == "b"
    holders = [_fingerprint("a", TURN_1 + [0], running=2), _fingerprint("b", TURN_1 + [0])]
    assert _choose(holders, TURN_2) == "b"  # equal hits: the less busy


def test_new_conversations_spread_over_the_least_busy() -> None:
    prints = [_fingerprint("a", SYSTEM + [0], running=1), _fingerprint("b", SYSTEM + [0])]
    assert _choose(prints, SYSTEM + list(range(60, 70))) == "b"
    idle = [_fingerprint("a", [0]), _fingerprint("b", [0])]
    assert {_choose(idle, list(range(200, 230))) for _ in range(20)} <= {"a", "b"}


def test_a_busy_or_full_holder_is_passed_over() -> None:
    busy = [_fingerprint("a", SYSTEM + [0]), _fingerprint("b", TURN_1 + [0], running=3)]
    assert _choose(busy, TURN_2) == "a"  # 3 sequences more than a: beyond the imbalance
    full = [_fingerprint("a", SYSTEM + [0], room=0), _fingerprint("b", TURN_1 + [0], room=0)]
    assert _choose(full, TURN_2) is None  # nobody has room: anyone may take it


def test_a_worker_without_a_fingerprint_counts_as_idle() -> None:
    assert _choose([_fingerprint("a", TURN_1 + [0])], TURN_2) == "a"
    assert _choose([_fingerprint("a", TURN_1 + [0], running=3)], TURN_2) is None
    assert _choose([_fingerprint("a", TURN_1 + [0])], TURN_2, num_workers=1) is None


def test_jobs_routed_since_a_fingerprint_count_as_load() -> None:
    router = PrefixRouter(None, Keys("p"), None, enabled=True, max_imbalance=2)  # type: ignore[arg-type]
    prints = [_fingerprint("a", TURN_1 + [0]), _fingerprint("b", SYSTEM + [0])]
    for _ in range(3):
        router._note_routed("a")
    (a, b) = router._candidates(prints, TURN_2)
    assert (a.load, a.room, b.load) == (3, 1, 0)
    assert choose_worker([a, b], 2, 2) == "b"


def test_a_damaged_fingerprint_counts_as_holding_nothing() -> None:
    bad = _fingerprint("a", TURN_1 + [0]).model_copy(update={"filter": "not base64!"})
    assert _choose([bad, _fingerprint("b", SYSTEM + [0])], TURN_2) == "b"


def test_a_routed_job_is_held_for_its_worker_until_the_hold_ends() -> None:
    """The store names the worker under the job's routed key, expiring with the hold."""
    from api.jobs.store import JobStore
    from api.keys.limits import RateLimiter
    from shared.config import Settings
    from shared.contracts import JobPayload

    async def scenario() -> None:
        redis = ArqRedis(connection_pool=fakeredis.FakeAsyncRedis().connection_pool)
        keys = Keys("p")
        settings = Settings(_env_file=None, key_prefix="p", prefix_routing_hold_ms=500)
        store = JobStore(redis, keys, settings, RateLimiter(redis, keys))
        for job_id, routed_to in (("job-1", "w1"), ("job-2", None)):
            payload = JobPayload(
                id=job_id, endpoint="completions", model="m", prompt_token_ids=[1, 2, 3]
            )
            await store._enqueue(payload, "/v1/completions", only_new=False, routed_to=routed_to)
        assert await redis.get(keys.routed("job-1")) == b"w1"
        assert 0 < await redis.pttl(keys.routed("job-1")) <= 500
        assert await redis.exists(keys.routed("job-2")) == 0
        assert await redis.zcard(keys.queue("m")) == 2  # both due at once
        assert (await store.get("job-1")).routed_to == "w1"

    asyncio.run(scenario())

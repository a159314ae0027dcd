"""Exact bookkeeping of the paged-KV block manager: block ids, ref counts, LRU, prefix hits."""

from __future__ import annotations

import pytest

from worker.engine.core import block_manager as bm_module
from worker.engine.core.block_manager import BlockManager, hash_block
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams

BS = 4


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(temperature=0.0), max_tokens=8)


def admit(bm: BlockManager, request: Request) -> int:
    """Admission as the scheduler does it: prefix lookup, then slots for the rest."""
    num_cached = bm.allocate_prefix(request)
    request.num_computed_tokens = num_cached
    assert bm.allocate_slots(request, request.num_tokens - num_cached)
    return num_cached


def compute_all(bm: BlockManager, request: Request) -> None:
    """Pretend the runner computed every known token."""
    request.num_computed_tokens = request.num_tokens
    bm.cache_full_blocks(request, request.num_computed_tokens)


def ref_counts(bm: BlockManager) -> list[int]:
    return [bm.get_ref_count(block_id) for block_id in range(bm.num_blocks)]


@pytest.fixture
def bm() -> BlockManager:
    return BlockManager(num_blocks=8, block_size=BS)


def test_fresh_allocation_and_free(bm: BlockManager) -> None:
    req = make_request("a", list(range(10)))
    assert bm.allocate_prefix(req) == 0
    assert bm.get_block_ids("a") == []
    assert bm.allocate_slots(req, 10)
    assert bm.get_block_ids("a") == [0, 1, 2]
    assert ref_counts(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert (bm.num_free_blocks, bm.num_used_blocks, bm.usage) == (5, 3, 3 / 8)
    bm.free("a")
    assert bm.get_block_ids("a") == []
    assert ref_counts(bm) == [0] * 8
    # Unused blocks first, then the freed table in reverse order.
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert bm.num_free_blocks == bm.num_blocks


def test_allocate_slots_grows_at_block_boundaries(bm: BlockManager) -> None:
    req = make_request("a", list(range(4)))
    admit(bm, req)
    assert bm.get_block_ids("a") == [0]
    compute_all(bm, req)
    req.append_output_token(100)  # 5 tokens: the decode of token 4 needs a second block
    assert bm.allocate_slots(req, 1)
    assert bm.get_block_ids("a") == [0, 1]
    req.num_computed_tokens = 5
    req.append_output_token(101)
    assert bm.allocate_slots(req, 1)  # token 5 fits in block 1
    assert bm.get_block_ids("a") == [0, 1]
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_allocate_slots_failure_changes_nothing() -> None:
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(bm, a)
    b = make_request("b", list(range(50, 58)))
    assert bm.allocate_prefix(b) == 0
    assert not bm.allocate_slots(b, 8)
    assert bm.get_block_ids("b") == []
    assert bm.free_block_ids() == [2]
    assert ref_counts(bm) == [1, 1, 0]
    bm.free("b")
    bm.free("a")
    assert bm.num_free_blocks == 3


def test_prefix_hit_shares_blocks_with_ref_count_two(bm: BlockManager) -> None:
    a = make_request("a", list(range(10)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2  # blocks 0 and 1 are full; block 2 holds 2 tokens
    b = make_request("b", list(range(8)) + [77, 78, 79])
    assert bm.allocate_prefix(b) == 8
    assert bm.get_block_ids("b") == [0, 1]
    assert ref_counts(bm)[:3] == [2, 2, 1]
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 3)
    assert bm.get_block_ids("b") == [0, 1, 3]
    # a's admission: 10 queried, 0 hit; b's: 11 queried, 8 hit.
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (21, 8)
    bm.free("a")
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert bm.free_block_ids() == [4, 5, 6, 7, 2]
    bm.free("b")
    assert bm.free_block_ids() == [4, 5, 6, 7, 2, 3, 1, 0]
    assert bm.num_free_blocks == 8


def test_last_token_is_never_taken_from_cache(bm: BlockManager) -> None:
    a = make_request("a", list(range(8)))
    admit(bm, a)
    compute_all(bm, a)
    assert bm.num_cached_blocks == 2
    exact = make_request("exact", list(range(8)))  # exactly 2 full blocks
    assert bm.allocate_prefix(exact) == 4
    assert bm.get_block_ids("exact") == [0]
    longer = make_request("longer", list(range(9)))
    assert bm.allocate_prefix(longer) == 8
    assert bm.get_block_ids("longer") == [0, 1]
    assert ref_counts(bm)[:2] == [3, 2]
    for request_id in ("a", "exact", "longer"):
        bm.free(request_id)
    assert bm.num_free_blocks == 8


def test_hit_revives_free_cached_block(bm: BlockManager) -> None:
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    assert bm.num_free_blocks == 8
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    b = make_request("b", list(range(9)))
    assert bm.allocate_prefix(b) == 8
    assert bm.get_block_ids("b") == [0, 1]
    assert ref_counts(bm)[:3] == [1, 1, 0]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2]
    assert bm.num_free_blocks == 6
    b.num_computed_tokens = 8
    assert bm.allocate_slots(b, 1)
    assert bm.get_block_ids("b") == [0, 1, 3]  # the uncached head of the free list
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_lru_evicts_least_recently_freed_and_drops_hashes() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    assert bm.free_block_ids() == [2, 3, 1, 0]
    b = make_request("b", list(range(100, 108)))
    admit(bm, b)
    assert bm.get_block_ids("b") == [2, 3]
    compute_all(bm, b)
    bm.free("b")
    assert bm.free_block_ids() == [1, 0, 3, 2]
    assert bm.num_cached_blocks == 4
    c = make_request("c", list(range(200, 212)))
    admit(bm, c)
    # a's blocks went first (tail block 1 before head block 0), then b's tail block 3.
    assert bm.get_block_ids("c") == [1, 0, 3]
    assert bm.num_cached_blocks == 1  # only b's head block 2 is still cached
    bm.free("c")
    a_again = make_request("a2", list(range(9)))
    assert bm.allocate_prefix(a_again) == 0
    b_again = make_request("b2", list(range(100, 109)))
    assert bm.allocate_prefix(b_again) == 4
    assert bm.get_block_ids("b2") == [2]
    bm.free("a2")
    bm.free("b2")
    assert bm.num_free_blocks == 4


def test_hash_chain_continues_after_hit(bm: BlockManager) -> None:
    a = make_request("a", list(range(5)))
    admit(bm, a)
    compute_all(bm, a)
    b = make_request("b", list(range(13)))
    assert admit(bm, b) == 4
    assert bm.get_block_ids("b") == [0, 2, 3, 4]
    compute_all(bm, b)
    c = make_request("c", list(range(13)))
    assert bm.allocate_prefix(c) == 12
    assert bm.get_block_ids("c") == [0, 2, 3]
    assert ref_counts(bm)[:5] == [3, 1, 2, 2, 1]
    for request_id in ("a", "b", "c"):
        bm.free(request_id)
    assert bm.num_free_blocks == 8


def test_same_content_computed_twice_is_cached_once(bm: BlockManager) -> None:
    a = make_request("a", list(range(9)))
    b = make_request("b", list(range(9)))
    admit(bm, a)
    admit(bm, b)  # a has not computed yet: no hit
    assert bm.get_block_ids("b") == [3, 4, 5]
    compute_all(bm, a)
    compute_all(bm, b)
    assert bm.num_cached_blocks == 2
    c = make_request("c", list(range(9)))
    assert bm.allocate_prefix(c) == 8
    assert bm.get_block_ids("c") == [0, 1]
    for request_id in ("a", "b", "c"):
        bm.free(request_id)
    assert bm.num_free_blocks == 8


def test_hash_collision_does_not_give_wrong_blocks(
    bm: BlockManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, token_ids: b"same")
    a = make_request("a", list(range(5)))
    admit(bm, a)
    compute_all(bm, a)
    b = make_request("b", [9, 9, 9, 9, 9])
    assert bm.allocate_prefix(b) == 0
    assert bm.num_prefix_hit_tokens == 0
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_hash_is_deterministic_and_chained() -> None:
    first = hash_block(None, (1, 2, 3, 4))
    assert first == hash_block(None, (1, 2, 3, 4))
    assert first != hash_block(None, (1, 2, 3, 5))
    assert hash_block(first, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))


def test_reset_prefix_cache_forgets_hashes(bm: BlockManager) -> None:
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0
    b = make_request("b", list(range(9)))
    assert bm.allocate_prefix(b) == 0
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = make_request("a", list(range(9)))
    admit(bm, a)
    compute_all(bm, a)
    bm.free("a")
    b = make_request("b", list(range(9)))
    assert admit(bm, b) == 0
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (0, 0)
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_failed_admission_is_not_counted() -> None:
    bm = BlockManager(num_blocks=2, block_size=BS)
    a = make_request("a", list(range(8)))
    admit(bm, a)
    b = make_request("b", list(range(50, 55)))
    assert bm.allocate_prefix(b) == 0
    assert not bm.allocate_slots(b, 5)
    bm.free("b")  # the scheduler undoes a failed admission
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (8, 0)
    bm.free("a")
    assert bm.num_free_blocks == 2


def test_allocate_prefix_rejects_request_holding_blocks(bm: BlockManager) -> None:
    a = make_request("a", list(range(5)))
    admit(bm, a)
    with pytest.raises(RuntimeError):
        bm.allocate_prefix(a)
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_free_tail_releases_rolled_back_blocks_first_in_line(bm: BlockManager) -> None:
    """Speculation's rollback: blocks past the kept tokens are released, unhashed, and
    reused before free blocks that still cache a prefix."""
    cached = make_request("c", list(range(100, 108)))
    admit(bm, cached)
    compute_all(bm, cached)
    bm.free("c")  # blocks 1, 0 stay cached on the free list
    req = make_request("a", list(range(6)))
    admit(bm, req)
    req.num_computed_tokens, req.output_token_ids = 6, [6]  # prefilled, one token sampled
    assert bm.allocate_slots(req, 1 + 9)  # the last token and 9 drafts: positions 6..15
    assert bm.get_block_ids("a") == [2, 3, 4, 5]
    req.num_computed_tokens += 1 + 1  # one draft kept, then a correction: 9 tokens known
    req.output_token_ids += [7, 99]
    bm.free_tail("a", req.num_tokens)
    bm.cache_full_blocks(req, req.num_computed_tokens)
    assert bm.get_block_ids("a") == [2, 3, 4]
    assert ref_counts(bm) == [0, 0, 1, 1, 1, 0, 0, 0]
    assert bm.free_block_ids()[0] == 5 and bm.free_block_ids()[-2:] == [1, 0]
    assert bm.num_cached_blocks == 4  # "c"'s two, [0 1 2 3] and [4 5 6 7]; not [99 ...]
    bm.free_tail("a", req.num_tokens)  # nothing past the kept tokens: no change
    assert bm.get_block_ids("a") == [2, 3, 4]
    bm.free("a")
    assert ref_counts(bm) == [0] * 8

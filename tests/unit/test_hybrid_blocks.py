"""Exact bookkeeping of the two-pool block manager (global and sliding-window layers):
local blocks released as the window slides, prefix hits across both pools, preemption,
every block free afterwards."""

from __future__ import annotations

import pytest

from worker.engine.core.hybrid_blocks import HybridBlockManager, local_blocks_needed
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams

BS = 4
WINDOW = 6  # a query sees itself and the 5 positions before it
NULL = 10  # the local pool's null block: its size


def make_request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, list(token_ids), SamplingParams(temperature=0.0), max_tokens=64)


@pytest.fixture
def hbm() -> HybridBlockManager:
    return HybridBlockManager(num_blocks=16, num_local_blocks=NULL, block_size=BS, window=WINDOW)


def step(hbm: HybridBlockManager, request: Request, num_new: int) -> None:
    """One scheduled step of `num_new` tokens, computed."""
    assert hbm.allocate_slots(request, num_new)
    request.num_computed_tokens += num_new
    hbm.cache_full_blocks(request, request.num_computed_tokens)


def decode(hbm: HybridBlockManager, request: Request, num_steps: int) -> None:
    for i in range(num_steps):
        request.append_output_token(100 + i)
        step(hbm, request, 1)


def all_free(hbm: HybridBlockManager) -> bool:
    return (
        hbm.full.num_free_blocks == hbm.full.num_blocks
        and hbm.local.num_free_blocks == hbm.local.num_blocks
    )


def test_local_blocks_slide_out_while_full_blocks_stay(hbm):
    request = make_request("a", list(range(10)))
    assert hbm.allocate_prefix(request) == 0
    step(hbm, request, 10)  # positions 0-9: the step's first query (0) sees from block 0
    assert hbm.get_block_ids("a") == [0, 1, 2]
    assert hbm.get_local_block_ids("a") == [0, 1, 2]
    decode(hbm, request, 1)  # query at 10 sees 5..10: block 0 (0-3) is out
    assert hbm.get_local_block_ids("a") == [NULL, 1, 2]
    assert hbm.local.get_ref_count(0) == 0 and hbm.local.free_block_ids()[-1] == 0
    decode(hbm, request, 6)  # last query at 16 sees 11..16: blocks 0-1 out, block 4 new
    assert hbm.get_block_ids("a") == [0, 1, 2, 3, 4]
    assert hbm.get_local_block_ids("a") == [NULL, NULL, 2, 3, 4]
    assert hbm.local.num_used_blocks == 3 and hbm.full.num_used_blocks == 5
    hbm.free("a")
    assert all_free(hbm)


def test_a_long_sequence_holds_a_window_of_local_blocks(hbm):
    request = make_request("a", [7] * 3)
    hbm.allocate_prefix(request)
    step(hbm, request, 3)
    decode(hbm, request, 50)  # 53 tokens: 14 full blocks, at most 3 local ones
    assert hbm.full.num_used_blocks == 14
    assert hbm.local.num_used_blocks <= 3
    held = [b for b in hbm.get_local_block_ids("a") if b != NULL]
    assert held == hbm.get_local_block_ids("a")[-len(held) :]  # only the tail is held
    hbm.free("a")
    assert all_free(hbm)


def test_prefix_hit_takes_the_window_of_local_blocks(hbm):
    prompt = list(range(14))  # 3 full blocks may come from the cache (never the last token)
    first = make_request("a", prompt)
    hbm.allocate_prefix(first)
    step(hbm, first, 14)
    hbm.free("a")
    second = make_request("b", prompt + [99])
    assert hbm.allocate_prefix(second) == 12
    # the first query (12) sees 7..12: local blocks 1 and 2, block 0 is null
    assert hbm.get_block_ids("b") == hbm.full.get_block_ids("b")
    assert hbm.get_local_block_ids("b")[0] == NULL
    assert [hbm.local.get_ref_count(b) for b in hbm.get_local_block_ids("b")[1:]] == [1, 1]
    second.num_computed_tokens = 12
    step(hbm, second, 3)
    assert hbm.num_prefix_hit_tokens == 12
    hbm.free("b")
    assert all_free(hbm)


def test_cached_hashes_are_the_full_pools(hbm):
    request = make_request("a", list(range(10)))
    hbm.allocate_prefix(request)
    step(hbm, request, 10)
    assert len(hbm.cached_hashes()) == 2  # two full blocks of 4
    assert hbm.cached_hashes() == hbm.full.cached_hashes()


def test_prefix_hit_shrinks_to_what_the_local_pool_still_holds(hbm):
    prompt = list(range(14))
    first = make_request("a", prompt)
    hbm.allocate_prefix(first)
    step(hbm, first, 14)
    decode(hbm, first, 8)  # the prompt's local blocks 1 and 2 slide out (kept, hashed, free)
    hbm.free("a")
    filler = make_request("f", [500 + i for i in range(36)])  # evicts local blocks
    hbm.allocate_prefix(filler)
    step(hbm, filler, 36)
    hbm.free("f")
    second = make_request("b", prompt + [99])
    cached = hbm.allocate_prefix(second)
    # whatever it hits, the local pool holds every block the first query sees
    first_needed = hbm.first_needed_block(cached)
    local = hbm.get_local_block_ids("b")
    assert len(local) == cached // BS and NULL not in local[first_needed:]
    assert hbm.get_block_ids("b")[: cached // BS] == hbm.full.get_block_ids("b")
    hbm.free("b")
    assert all_free(hbm)


def test_allocation_fails_without_change_when_the_local_pool_is_short():
    hbm = HybridBlockManager(num_blocks=32, num_local_blocks=3, block_size=BS, window=WINDOW)
    a, b = make_request("a", list(range(8))), make_request("b", list(range(50, 58)))
    hbm.allocate_prefix(a)
    step(hbm, a, 8)  # local: 2 blocks
    hbm.allocate_prefix(b)
    assert not hbm.allocate_slots(b, 8)  # needs 2, 1 free
    assert hbm.get_block_ids("b") == [] and hbm.full.num_used_blocks == 2
    hbm.free("a")  # preemption frees both pools
    assert hbm.allocate_slots(b, 8)
    hbm.free("b")
    assert all_free(hbm)


def test_speculative_rollback_and_reset_keep_the_pools_consistent(hbm):
    request = make_request("a", list(range(9)))
    hbm.allocate_prefix(request)
    step(hbm, request, 9)
    assert hbm.allocate_slots(request, 5)  # drafts up to position 13
    hbm.free_tail("a", 10)
    assert len(hbm.get_block_ids("a")) == 3 and len(hbm.get_local_block_ids("a")) == 3
    hbm.reset_prefix_cache()
    hbm.free("a")
    assert all_free(hbm) and hbm.full.num_cached_blocks == 0


def test_local_pool_size_covers_every_sequence_and_a_step():
    assert local_blocks_needed(512, 16, 4, 1024) == 4 * 33 + 64 + 1

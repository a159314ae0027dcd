"""KV blocks of a model with global and sliding-window layers (Gemma 2 and 3): two pools.

Global layers keep every block of a sequence (the `full` pool, what `BlockManager` does).
Sliding-window layers read only a sequence's last `window` positions, so their blocks live
in a pool of their own (`local`), and a block whose positions have all slid out of the
window is released as the sequence grows: its table entry becomes the null block (an id
past the pool, which the attention never reads unmasked) and the block joins the free list
with its hash, as a finished request's would. A long sequence then holds about
`window / block_size + 1` local blocks instead of one per `block_size` tokens (vLLM's
hybrid allocator does the same with its sliding-window group).

Prefix caching spans both pools: a hit of `m` blocks needs the full pool's first `m` blocks
and, in the local pool, those under the window of the first position computed (`m *
block_size`), so the hit is the longest that both hold. Preemption frees both tables.
Counts the scheduler reads (`num_blocks`, usage, prefix statistics) are the full pool's.
"""

from __future__ import annotations

from shared.prefixes import BlockHash
from worker.engine.core.block_manager import BlockManager, cdiv
from worker.engine.core.request import Request


def local_blocks_needed(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """A local pool large enough for `max_num_seqs` sequences at their window each, plus a
    step's worth of new tokens (one chunk may span a window and a whole token budget)."""
    per_sequence = cdiv(window, block_size) + 1
    return max_num_seqs * per_sequence + cdiv(max_num_batched_tokens, block_size) + 1


class HybridBlockManager:
    """The scheduler's block manager for a model with global and sliding-window layers."""

    def __init__(
        self,
        num_blocks: int,
        num_local_blocks: int,
        block_size: int,
        window: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.full = BlockManager(num_blocks, block_size, enable_prefix_caching)
        # the null block is the runner's scratch block past the local pool
        self.local = BlockManager(
            num_local_blocks, block_size, enable_prefix_caching, null_block=num_local_blocks
        )
        self.window = window
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching

    # ---- what the scheduler and the engine read (the full pool's) ------------------------

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.full.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.full.num_used_blocks

    @property
    def usage(self) -> float:
        return max(self.full.usage, self.local.usage)

    @property
    def num_cached_blocks(self) -> int:
        return self.full.num_cached_blocks

    @property
    def num_prefix_query_tokens(self) -> int:
        return self.full.num_prefix_query_tokens

    @property
    def num_prefix_hit_tokens(self) -> int:
        return self.full.num_prefix_hit_tokens

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """The full pool's cached hashes (what routing matches prompts against; a hit may
        still shrink to what the local pool holds)."""
        return self.full.cached_hashes()

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.full.get_block_ids(request_id)

    def get_local_block_ids(self, request_id: str) -> list[int]:
        return self.local.get_block_ids(request_id)

    def get_ref_count(self, block_id: int) -> int:
        return self.full.get_ref_count(block_id)

    def free_block_ids(self) -> list[int]:
        return self.full.free_block_ids()

    # ---- allocation ----------------------------------------------------------------------

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` reads in a window layer."""
        return max(position - self.window + 1, 0) // self.block_size

    def allocate_prefix(self, request: Request) -> int:
        chain = self.full.prefix_chain(request)
        if self.local.get_block_ids(request.request_id):
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        num_hit = self.full.num_cached_prefix(chain)
        while num_hit and not self._local_holds(chain, num_hit):
            num_hit -= 1
        first = self.first_needed_block(num_hit * self.block_size)
        self.local.take_prefix(request, chain, num_hit, first, count_stats=False)
        return self.full.take_prefix(request, chain, num_hit)

    def _local_holds(self, chain: list, num_blocks: int) -> bool:
        first = self.first_needed_block(num_blocks * self.block_size)
        return all(self.local.is_cached(chain, i) for i in range(first, num_blocks))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Release the local blocks this step's queries no longer see, then grow both tables;
        False (and neither table grown) when either pool is short. The release stands even
        then: the request's computed length only grows, so those blocks are never read."""
        drop = self.first_needed_block(request.num_computed_tokens)
        self.local.release_before(request.request_id, drop)
        if self.full.blocks_needed(request, num_new_tokens) > self.full.num_free_blocks:
            return False
        if self.local.blocks_needed(request, num_new_tokens) > self.local.num_free_blocks:
            return False
        return self.full.allocate_slots(request, num_new_tokens) and self.local.allocate_slots(
            request, num_new_tokens
        )

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.full.cache_full_blocks(request, num_computed_tokens)
        self.local.cache_full_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self.full.free(request_id)
        self.local.free(request_id)

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        self.full.free_tail(request_id, num_tokens)
        self.local.free_tail(request_id, num_tokens)

    def reset_prefix_cache(self) -> None:
        self.full.reset_prefix_cache()
        self.local.reset_prefix_cache()

"""Paged KV-cache bookkeeping with prefix caching (pure Python; never imports torch).

Every request owns a block table: a list of block ids, block `i` holding the KV of tokens
`[i * block_size, (i + 1) * block_size)`. A block that is full and computed is registered
under a chained hash (sha256 of the parent block's hash and the block's token ids), so a
later request with the same prefix can take a reference on it instead of recomputing it.
Blocks whose reference count drops to 0 go to the tail of an LRU free list *keeping* their
hash; taking a free block from the head evicts its hash, and a prefix hit on a free cached
block takes it back out of the free list.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.prefixes import BlockHash, hash_block
from worker.engine.core.request import Request


@dataclass
class KVBlock:
    """One physical block. `block_hash` and `token_ids` are set while it caches content."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to requests, shares full blocks by prefix hash, counts hits."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        null_block: int | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        # A table entry that holds no block (a sliding-window group's blocks that slid out):
        # an id past the pool, never allocated, counted or freed.
        self.null_block = null_block
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        # Head = least recently freed = evicted first.
        self._free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self._tables: dict[str, list[int]] = {}
        # Chained hashes of each request's full computed blocks, in table order.
        self._hashes: dict[str, list[BlockHash]] = {}
        # (query, hit) tokens of an admission attempt, counted once its slots are allocated,
        # so a request that waits several steps for blocks is counted once.
        self._pending_stats: dict[str, tuple[int, int]] = {}
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0
        # The cached hashes as of the last change, rebuilt only after one (a worker publishes
        # them as its prefix fingerprint).
        self._cached_snapshot: tuple[BlockHash, ...] | None = ()

    # ---- state ---------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, including free blocks that still hold a cached hash."""
        return len(self._free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self._cached)

    def cached_hashes(self) -> tuple[BlockHash, ...]:
        """Every hash the prefix cache holds now; the same tuple until the cache changes."""
        if self._cached_snapshot is None:
            self._cached_snapshot = tuple(self._cached)
        return self._cached_snapshot

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    def get_local_block_ids(self, request_id: str) -> list[int] | None:
        """One pool serves every layer (see `HybridBlockManager` for two)."""
        return None

    def get_ref_count(self, block_id: int) -> int:
        return self.blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (next to be reused first)."""
        return list(self._free_ids)

    # ---- allocation ----------------------------------------------------------------------

    def allocate_prefix(self, request: Request) -> int:
        """Take references on the cached full blocks that prefix the request's tokens.

        Call when the request holds no blocks. Never covers the last token (its logits are
        needed), so at most `num_tokens - 1` tokens come from the cache. Sets the request's
        block table and returns the number of cached tokens (a multiple of block_size).
        """
        chain = self.prefix_chain(request)
        return self.take_prefix(request, chain, self.num_cached_prefix(chain))

    def prefix_chain(self, request: Request) -> list[tuple[BlockHash, tuple[int, ...]]]:
        """(hash, token ids) of each full block a prefix hit may cover, in order."""
        if self._tables.get(request.request_id):
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        if not self.enable_prefix_caching:
            return []
        chain: list[tuple[BlockHash, tuple[int, ...]]] = []
        parent: BlockHash | None = None
        for index in range((request.num_tokens - 1) // self.block_size):
            token_ids = tuple(self._block_tokens(request, index))
            parent = hash_block(parent, token_ids)
            chain.append((parent, token_ids))
        return chain

    def is_cached(self, chain: list[tuple[BlockHash, tuple[int, ...]]], index: int) -> bool:
        block_hash, token_ids = chain[index]
        parent = chain[index - 1][0] if index else None
        return self._lookup(block_hash, parent, token_ids) is not None

    def num_cached_prefix(self, chain: list[tuple[BlockHash, tuple[int, ...]]]) -> int:
        """How many of the chain's blocks, from the first, are cached."""
        for index in range(len(chain)):
            if not self.is_cached(chain, index):
                return index
        return len(chain)

    def take_prefix(
        self,
        request: Request,
        chain: list[tuple[BlockHash, tuple[int, ...]]],
        num_blocks: int,
        first: int = 0,
        count_stats: bool = True,
    ) -> int:
        """Reference the chain's cached blocks [first, num_blocks) as the request's table
        (entries before `first` are the null block); returns the tokens they cover."""
        request_id = request.request_id
        self._tables[request_id] = [self.null_block] * first  # type: ignore[list-item]
        self._hashes[request_id] = [block_hash for block_hash, _ in chain[:first]]
        for index in range(first, num_blocks):
            block_hash, token_ids = chain[index]
            parent = chain[index - 1][0] if index else None
            block = self._lookup(block_hash, parent, token_ids)
            if block is None:
                raise RuntimeError("take_prefix on a block that is not cached")
            self._take_ref(block)
            self._tables[request_id].append(block.block_id)
            self._hashes[request_id].append(block_hash)
        num_cached_tokens = num_blocks * self.block_size
        if count_stats and self.enable_prefix_caching:
            self._pending_stats[request_id] = (request.num_tokens, num_cached_tokens)
        return num_cached_tokens

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Free blocks `allocate_slots(request, num_new_tokens)` would take."""
        table = self._tables.get(request.request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        return max(num_needed - len(table), 0)

    def release_before(self, request_id: str, num_blocks: int) -> None:
        """Drop the request's first `num_blocks` blocks (their entries become the null block;
        blocks reaching 0 references join the free list's tail with their hashes)."""
        table = self._tables.get(request_id, [])
        for index in range(min(num_blocks, len(table))):
            if table[index] != self.null_block:
                self._release(self.blocks[table[index]])
                table[index] = self.null_block  # type: ignore[call-overload]

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the block table to cover `num_computed_tokens + num_new_tokens` tokens.

        Returns False and changes nothing when there are not enough free blocks.
        """
        request_id = request.request_id
        table = self._tables.setdefault(request_id, [])
        self._hashes.setdefault(request_id, [])
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_needed - len(table)
        if num_new_blocks > len(self._free_ids):
            return False
        for _ in range(max(num_new_blocks, 0)):
            block_id, _ = self._free_ids.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            table.append(block_id)
        stats = self._pending_stats.pop(request_id, None)
        if stats is not None:
            self.num_prefix_query_tokens += stats[0]
            self.num_prefix_hit_tokens += stats[1]
        return True

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register hashes for the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        hashes = self._hashes.get(request.request_id)
        if table is None or hashes is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        for index in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            token_ids = tuple(self._block_tokens(request, index))
            block_hash = hash_block(parent, token_ids)
            hashes.append(block_hash)
            if table[index] == self.null_block:
                continue
            block = self.blocks[table[index]]
            # A block computed twice by concurrent requests is cached once; the copy that
            # lost the race stays unhashed and is simply reused when freed.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.parent_hash = parent
                block.token_ids = token_ids
                self._cached[block_hash] = block.block_id
                self._cached_snapshot = None

    def free(self, request_id: str) -> None:
        """Drop the request's references; blocks reaching 0 join the free list's tail.

        The table is walked in reverse, so a sequence's tail blocks are evicted before its
        head (a shared prefix outlives the suffixes hanging off it). Hashes are kept.
        """
        table = self._tables.pop(request_id, [])
        self._hashes.pop(request_id, None)
        self._pending_stats.pop(request_id, None)
        for block_id in reversed(table):
            if block_id != self.null_block:
                self._release(self.blocks[block_id])

    def free_tail(self, request_id: str, num_tokens: int) -> None:
        """Release the request's blocks past those covering its first `num_tokens` tokens.

        Speculation rolls back this way: blocks that held only rejected drafts were never
        hashed (hashing stops at the computed length), hold nothing worth keeping, and go to
        the head of the free list, to be reused before any block that caches a prefix.
        """
        table = self._tables.get(request_id)
        if table is None:
            return
        num_kept = cdiv(num_tokens, self.block_size)
        while len(table) > num_kept:
            block_id = table.pop()
            if block_id == self.null_block:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_ids[block.block_id] = None
                self._free_ids.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use stay allocated but are no longer shared."""
        for block in self.blocks:
            block.block_hash = block.parent_hash = block.token_ids = None
        self._cached.clear()
        self._cached_snapshot = None

    # ---- internals -----------------------------------------------------------------------

    def _block_tokens(self, request: Request, index: int) -> list[int]:
        start = index * self.block_size
        return request.token_ids_slice(start, start + self.block_size)

    def _lookup(
        self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...]
    ) -> KVBlock | None:
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        # Compare content too: a hash collision must never yield wrong KV.
        if block.parent_hash != parent or block.token_ids != token_ids:
            return None
        return block

    def _release(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free_ids[block.block_id] = None

    def _take_ref(self, block: KVBlock) -> None:
        if block.ref_count == 0:
            del self._free_ids[block.block_id]
        block.ref_count += 1

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            self._cached_snapshot = None
        block.block_hash = block.parent_hash = block.token_ids = None

"""Prefix fingerprints: the chained block hashes of the prefix cache, and a Bloom filter of them.

The worker's block manager registers each full, computed block of KV under the hash of its
parent block's hash and its token ids (`hash_block`); the API hashes a prompt's leading full
blocks the same way (`prompt_block_hashes`) and asks each worker's published filter how many
of them it holds (`PrefixFilter.leading_hits`). One function on both sides, so they agree.
"""

from __future__ import annotations

import base64
import hashlib
from array import array
from collections.abc import Iterable, Sequence

BlockHash = bytes

# Bits per cached block (16 to 32 after rounding up): with 4 probes, at most ~1 false "held"
# in 400 lookups with the whole cache in the filter.
BITS_PER_BLOCK = 16
NUM_PROBES = 4
MIN_BITS = 1 << 10
MAX_BITS = 1 << 20  # 128 KiB: the published filter stays small whatever the cache's size


def hash_block(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained, deterministic hash of a full block (stable across processes and machines)."""
    hasher = hashlib.sha256(parent_hash or b"\x00")
    hasher.update(array("q", token_ids).tobytes())
    return hasher.digest()


def prompt_block_hashes(token_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """Chained hashes of the prompt's full blocks that a prefix cache could serve: never the
    block holding the last token, which is always computed (it yields the logits)."""
    hashes: list[BlockHash] = []
    parent: BlockHash | None = None
    for index in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def filter_bits_for(num_blocks: int) -> int:
    """A filter's size for a cache of `num_blocks` blocks: a power of two, bounded."""
    wanted = max(num_blocks * BITS_PER_BLOCK, MIN_BITS)
    return min(1 << (wanted - 1).bit_length(), MAX_BITS)


class PrefixFilter:
    """A Bloom filter of block hashes. The hashes are SHA-256 digests, so their own bytes
    serve as the probes. A false "held" only sends a request to a worker that lacks it."""

    def __init__(self, num_bits: int, bits: bytes | None = None) -> None:
        if num_bits < 8 or num_bits & (num_bits - 1):
            raise ValueError("num_bits must be a power of two of at least 8")
        self.num_bits = num_bits
        self.bits = bytearray(bits if bits is not None else num_bits // 8)
        if len(self.bits) != num_bits // 8:
            raise ValueError("the filter's bytes do not match its size")

    @classmethod
    def of(cls, hashes: Iterable[BlockHash], num_bits: int) -> PrefixFilter:
        """Every hash added at once: the same bits as `add` one by one, in 0.8 ms rather than
        10 ms for a 2 GiB pool's 5,825 blocks (the worker rebuilds it on the event loop,
        holding the GIL its engine thread needs)."""
        import numpy as np  # only the worker builds filters

        probes = b"".join(block_hash[: 4 * NUM_PROBES] for block_hash in hashes)
        words = np.frombuffer(probes, dtype="<u4") & (num_bits - 1)
        bits = np.zeros(num_bits // 8, dtype=np.uint8)
        np.bitwise_or.at(bits, words >> 3, np.left_shift(1, words & 7).astype(np.uint8))
        return cls(num_bits, bits.tobytes())

    def _probes(self, block_hash: BlockHash) -> list[int]:
        mask = self.num_bits - 1
        return [
            int.from_bytes(block_hash[4 * i : 4 * i + 4], "little") & mask
            for i in range(NUM_PROBES)
        ]

    def add(self, block_hash: BlockHash) -> None:
        for bit in self._probes(block_hash):
            self.bits[bit >> 3] |= 1 << (bit & 7)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return all(self.bits[bit >> 3] >> (bit & 7) & 1 for bit in self._probes(block_hash))

    def leading_hits(self, hashes: Sequence[BlockHash]) -> int:
        """How many of a prompt's chained block hashes, from the first, the filter holds."""
        for count, block_hash in enumerate(hashes):
            if block_hash not in self:
                return count
        return len(hashes)

    def encode(self) -> str:
        return base64.b64encode(bytes(self.bits)).decode()

    @classmethod
    def decode(cls, num_bits: int, text: str) -> PrefixFilter:
        return cls(num_bits, base64.b64decode(text))

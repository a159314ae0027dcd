"""The per-step attention context: set once by the runner, read by every attention layer.

Keeping it out of forward() signatures lets models stay plain `forward(input_ids, positions)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillChunkMeta:
    """One prefill chunk: tokens [token_start, token_start + num_tokens) of the flat batch.

    When `start_position` is 0 the chunk attends only to itself (plain causal attention on
    the new keys). Otherwise it attends to `context_slots` (the cache slots of positions
    [0, start_position + num_tokens)) under `mask` ([num_tokens, context_len], True = attend).
    """

    token_start: int
    num_tokens: int
    start_position: int
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Where this step's keys go and what each query attends to.

    Decode tokens come first: `num_decode_tokens` of them, one per sequence, attended in one
    batched op over `decode_block_tables` ([D, max_blocks]) with `decode_mask`, a float32
    additive key mask ([D, 1, max_blocks * block_size]: 0 = attend, -inf = padding).
    `decode_context_lens` ([D], int64) says how many keys each row has: the native kernel
    reads the block tables with it instead of the mask (absent where a CUDA graph pads rows).
    """

    slot_mapping: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefills: list[PrefillChunkMeta] = field(default_factory=list)


_CURRENT: AttentionMetadata | None = None


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    global _CURRENT
    _CURRENT = metadata


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("no attention metadata set for this step")
    return _CURRENT

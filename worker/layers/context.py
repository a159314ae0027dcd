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
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def mask_for(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """The boolean key mask for a layer that sees only the last `window` positions
        (None: `mask`, absent for a chunk attending causally to itself alone). Built once
        per step and window; keys are positions [0, start_position + num_tokens)."""
        if window is None:
            return self.mask
        if window not in self.window_masks:
            end = self.start_position + self.num_tokens
            keys = torch.arange(end)[None, :]
            queries = torch.arange(self.start_position, end)[:, None]
            mask = (keys <= queries) & (keys > queries - window)
            self.window_masks[window] = mask.to(device)
        return self.window_masks[window]


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
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    # the same step over the sliding-window layers' own pool, where they have one
    local: AttentionMetadata | None = None

    def decode_mask_for(self, window: int | None) -> torch.Tensor | None:
        """`decode_mask` with the keys before each row's last `window` positions masked
        too (a sliding-window layer); built once per step and window."""
        if window is None or self.decode_mask is None:
            return self.decode_mask
        if window not in self.window_masks:
            if self.decode_context_lens is None:
                raise RuntimeError("a sliding window needs the decode rows' context lengths")
            lens = self.decode_context_lens.to(self.decode_mask.device)
            keys = torch.arange(self.decode_mask.shape[-1], device=lens.device)
            early = keys[None, :] < (lens[:, None] - window)
            self.window_masks[window] = self.decode_mask.masked_fill(early[:, None], float("-inf"))
        return self.window_masks[window]

    def decode_starts(self, window: int | None) -> torch.Tensor | None:
        """Each decode row's first visible position under `window` (None: all from 0)."""
        if window is None or self.decode_context_lens is None:
            return None
        return (self.decode_context_lens - window).clamp_(min=0)


_CURRENT: AttentionMetadata | None = None


def set_attention_metadata(metadata: AttentionMetadata | None) -> None:
    global _CURRENT
    _CURRENT = metadata


def current_attention_metadata() -> AttentionMetadata | None:
    """This step's metadata, or None outside a paged step (a dense embedding forward)."""
    return _CURRENT


def get_attention_metadata() -> AttentionMetadata:
    if _CURRENT is None:
        raise RuntimeError("no attention metadata set for this step")
    return _CURRENT

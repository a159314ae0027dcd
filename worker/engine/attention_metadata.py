"""Turn a step's scheduled chunks into flat inputs and attention metadata (once per step)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from worker.engine.core.block_manager import cdiv
from worker.engine.core.outputs import ScheduledChunk
from worker.layers.context import AttentionMetadata, PrefillChunkMeta


@dataclass
class StepInputs:
    """Flat model inputs for one step plus where to read logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_indices: torch.Tensor


def slots_for(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions [start, end) for a sequence with this block table."""
    return [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]


def decode_context_lens(chunks: list[ScheduledChunk]) -> list[int]:
    """Keys each decode row attends to: one row per token, each seeing up to itself."""
    return [c.start_position + j + 1 for c in chunks for j in range(c.num_tokens)]


def decode_tensors(
    chunks: list[ScheduledChunk],
    block_size: int,
    num_rows: int | None = None,
    num_blocks: int | None = None,
    pad_block: int = 0,
    with_mask: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Block tables [R, max_blocks] and additive key mask [R, 1, max_blocks * bs].

    One row per token: a chunk with several tokens (drafts, or a prefill attended row by
    row) has a row for each of its positions, all on the same block table, each seeing the
    keys up to itself. By default R is the number of tokens and max_blocks the longest
    context's. A CUDA graph asks for fixed sizes instead: rows past the chunks point every
    block at `pad_block` and attend to its first slot only (no row is all -inf, so no NaN
    even in padding). The mask is only for the eager path (`with_mask`).
    """
    context_lens = decode_context_lens(chunks)
    max_blocks = num_blocks or max(
        cdiv(c.start_position + c.num_tokens, block_size) for c in chunks
    )
    # Padding points at a sequence's first block: any real block, masked out below.
    per_chunk = [
        c.block_ids[:max_blocks] + c.block_ids[:1] * (max_blocks - len(c.block_ids[:max_blocks]))
        for c in chunks
    ]
    tables = torch.tensor(per_chunk, dtype=torch.long).reshape(len(chunks), max_blocks)
    if any(c.num_tokens != 1 for c in chunks):  # a plain decode step has its rows already
        counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.long)
        tables = tables.repeat_interleave(counts, dim=0)
    num_pad = (num_rows or len(context_lens)) - len(context_lens)
    if num_pad:
        pad = torch.full((num_pad, max_blocks), pad_block, dtype=torch.long)
        tables = torch.cat([tables, pad])
    if not with_mask:
        return tables, None
    lens = torch.tensor(context_lens + [1] * num_pad, dtype=torch.long)
    padding = torch.arange(max_blocks * block_size)[None, :] >= lens[:, None]
    mask = torch.zeros(padding.shape, dtype=torch.float32).masked_fill_(padding, float("-inf"))
    return tables, mask[:, None, :]


def _prefill_meta(
    chunk: ScheduledChunk, token_start: int, block_size: int, device: torch.device
) -> PrefillChunkMeta:
    meta = PrefillChunkMeta(token_start, chunk.num_tokens, chunk.start_position)
    if chunk.start_position == 0:
        return meta
    context_len = chunk.start_position + chunk.num_tokens
    slots = slots_for(chunk.block_ids, 0, context_len, block_size)
    query_positions = torch.arange(chunk.start_position, context_len)
    mask = torch.arange(context_len)[None, :] <= query_positions[:, None]
    meta.context_slots = torch.tensor(slots, dtype=torch.long).to(device, non_blocking=True)
    meta.mask = mask.to(device, non_blocking=True)
    return meta


def build_step_inputs(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device, row_attention: bool = False
) -> StepInputs:
    """Flat input ids, positions, slot mapping and per-chunk attention metadata (and the same
    over the sliding-window layers' own tables, where the chunks have them).

    `row_attention`: every token, prefill ones too, is attended as a row of its own over its
    sequence's block table (the native kernel), so a row's result cannot depend on how its
    prompt was chunked or cached. No mask is built then."""
    input_ids: list[int] = []
    positions: list[int] = []
    logits_indices: list[int] = []
    for chunk in chunks:
        start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
        known_end = end - len(chunk.draft_token_ids)
        input_ids += chunk.request.token_ids_slice(start, known_end) + chunk.draft_token_ids
        positions += range(start, end)
        logits_indices += range(len(input_ids) - chunk.num_sampled_rows, len(input_ids))
    metadata = _metadata(chunks, block_size, device, row_attention)
    if any(chunk.local_block_ids is not None for chunk in chunks):
        local = [replace(c, block_ids=c.local_block_ids or c.block_ids) for c in chunks]
        metadata.local = _metadata(local, block_size, device, row_attention)
    return StepInputs(
        input_ids=_to(input_ids, device),
        positions=_to(positions, device),
        metadata=metadata,
        logits_indices=_to(logits_indices, device),
    )


def _metadata(
    chunks: list[ScheduledChunk], block_size: int, device: torch.device, row_attention: bool
) -> AttentionMetadata:
    """Slot mapping, prefill chunks and decode rows of a step over the chunks' block tables."""
    slot_mapping: list[int] = []
    prefills: list[PrefillChunkMeta] = []
    num_decode = num_decode_chunks = token_start = 0
    for chunk in chunks:
        start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
        if (row_attention or chunk.is_decode) and token_start == num_decode:
            num_decode += chunk.num_tokens
            num_decode_chunks += 1
        else:
            prefills.append(_prefill_meta(chunk, token_start, block_size, device))
        slot_mapping += slots_for(chunk.block_ids, start, end, block_size)
        token_start += chunk.num_tokens
    metadata = AttentionMetadata(
        slot_mapping=_to(slot_mapping, device), num_decode_tokens=num_decode, prefills=prefills
    )
    if num_decode:
        decode_chunks = chunks[:num_decode_chunks]
        tables, mask = decode_tensors(decode_chunks, block_size, with_mask=not row_attention)
        metadata.decode_block_tables = tables.to(device, non_blocking=True)
        metadata.decode_mask = None if mask is None else mask.to(device, non_blocking=True)
        metadata.decode_context_lens = _to(decode_context_lens(decode_chunks), device)
    return metadata


def _to(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)

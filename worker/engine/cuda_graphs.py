"""Decode steps replayed as CUDA graphs at padded sizes: the CUDA path's launch-free decode.

A decode step of a small model runs ~15 kernels per layer on a handful of tokens; on a GPU
their launches, not their math, set the step time. Each graph is the model's forward for a
fixed (batch rows, context blocks) shape, captured once on first use and replayed after
copying the step's inputs into its static tensors. Rows past the step's sequences are
padding: token 0 at position 0, writing K/V into the runner's scratch block, which the
block manager never hands out. Sizes are rounded up to buckets (batch 1, 2, 4, 8, then
multiples of 16; blocks in powers of two up to the longest context), so a few dozen graphs
cover every decode step; larger batches and mixed prefill steps run eagerly.

The replay mechanism is a backend: `CudaGraphBackend` on a GPU, `EagerReplay` (the same
static tensors and padding, re-run eagerly) to test all of the above on any device.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from worker.engine.attention_metadata import decode_tensors, slots_for
from worker.engine.core.block_manager import cdiv
from worker.engine.core.outputs import ScheduledChunk
from worker.layers.context import AttentionMetadata, set_attention_metadata

logger = logging.getLogger(__name__)

Replay = Callable[[], torch.Tensor]


class GraphBackend(Protocol):
    def capture(self, run: Replay) -> Replay:
        """Record `run` (which reads and writes only static tensors); return its replay."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture, all graphs sharing one memory pool.

    Graphs never run concurrently and each keeps its output tensor alive, so sharing the
    pool only lets their intermediates reuse the same memory.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, run: Replay) -> Replay:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up: cuBLAS handles and workspaces, lazy inits
            for _ in range(2):
                run()
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay


class EagerReplay:
    """Runs the function again at each replay, on the same static tensors (any device)."""

    def capture(self, run: Replay) -> Replay:
        run()
        return run


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed; the runner then runs every step eagerly."""


@dataclass
class _Graph:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    replay: Replay


def batch_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to and including max_batch_size."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += range(16, max_batch_size, 16)
    return sorted({*sizes, max_batch_size})


def block_buckets(max_blocks: int) -> list[int]:
    """Powers of two below max_blocks, then max_blocks."""
    sizes, size = [], 1
    while size < max_blocks:
        sizes.append(size)
        size *= 2
    return [*sizes, max_blocks]


def _round_up(value: int, buckets: list[int]) -> int:
    return next(b for b in buckets if b >= value)


class DecodeGraphs:
    """Per-(rows, blocks) graphs of `model.forward` for steps whose chunks are all 1 token."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        max_model_len: int,
        max_batch_size: int,
        scratch_block: int,
        device: torch.device,
        backend: GraphBackend,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.device = device
        self.backend = backend
        self.batch_buckets = batch_buckets(max_batch_size)
        self.block_buckets = block_buckets(cdiv(max_model_len, block_size))
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def supports(self, chunks: list[ScheduledChunk]) -> bool:
        return (
            0 < len(chunks) <= self.batch_buckets[-1]
            and all(c.num_tokens == 1 for c in chunks)
            and max(c.start_position for c in chunks) < self.block_buckets[-1] * self.block_size
        )

    def shape_for(self, chunks: list[ScheduledChunk]) -> tuple[int, int]:
        longest = max(c.start_position for c in chunks) + 1
        blocks = cdiv(longest, self.block_size)
        return _round_up(len(chunks), self.batch_buckets), _round_up(blocks, self.block_buckets)

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Hidden states [len(chunks), H] of a decode-only step, one row per chunk."""
        rows, blocks = key = self.shape_for(chunks)
        graph = self.graphs.get(key)
        if graph is None:
            try:
                graph = self._capture(rows, blocks)
            except Exception as exc:
                raise GraphCaptureError(f"{rows} rows x {blocks} blocks: {exc!r}") from exc
            self.graphs[key] = graph
        self._fill(graph, chunks, rows, blocks)
        return graph.replay()[: len(chunks)]

    def _fill(self, graph: _Graph, chunks: list[ScheduledChunk], rows: int, blocks: int) -> None:
        num_pad = rows - len(chunks)
        ids, positions, slots = [], [], []
        for chunk in chunks:
            position = chunk.start_position
            ids += chunk.request.token_ids_slice(position, position + 1)
            positions.append(position)
            slots += slots_for(chunk.block_ids, position, position + 1, self.block_size)
        pad_slot = self.scratch_block * self.block_size
        tables, mask = decode_tensors(chunks, self.block_size, rows, blocks, self.scratch_block)
        meta = graph.metadata
        graph.input_ids.copy_(torch.tensor(ids + [0] * num_pad), non_blocking=True)
        graph.positions.copy_(torch.tensor(positions + [0] * num_pad), non_blocking=True)
        meta.slot_mapping.copy_(torch.tensor(slots + [pad_slot] * num_pad), non_blocking=True)
        meta.decode_block_tables.copy_(tables, non_blocking=True)
        meta.decode_mask.copy_(mask, non_blocking=True)

    def _capture(self, rows: int, blocks: int) -> _Graph:
        started = time.perf_counter()
        # Until the first fill, every row is padding: warm-up and capture write K/V only into
        # the scratch block.
        tables, mask = decode_tensors([], self.block_size, rows, blocks, self.scratch_block)
        slots = torch.full((rows,), self.scratch_block * self.block_size, dtype=torch.long)
        metadata = AttentionMetadata(
            slot_mapping=slots.to(self.device),
            num_decode_tokens=rows,
            decode_block_tables=tables.to(self.device),
            decode_mask=mask.to(self.device),
        )
        input_ids = torch.zeros(rows, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)

        def forward() -> torch.Tensor:
            set_attention_metadata(metadata)
            try:
                return self.model(input_ids, positions)
            finally:
                set_attention_metadata(None)

        replay = self.backend.capture(forward)
        logger.info(
            "decode graph for %d rows x %d blocks captured in %.0f ms",
            rows,
            blocks,
            (time.perf_counter() - started) * 1000,
        )
        return _Graph(input_ids, positions, metadata, replay)

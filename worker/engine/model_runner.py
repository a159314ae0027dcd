"""Runs one engine step on the model: one batched forward over every scheduled token."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from worker.engine.attention_metadata import build_step_inputs
from worker.engine.compiled import CompileMode, compile_forward
from worker.engine.core.ngram import accept_drafts
from worker.engine.core.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from worker.engine.core.request import Request
from worker.engine.cuda_graphs import CudaGraphBackend, DecodeGraphs, GraphCaptureError
from worker.engine.kv_cache import KVCache, allocate_kv_cache, bind_kv_cache, window_layers
from worker.layers import native
from worker.layers.attention import PagedAttention
from worker.layers.changes import note_change
from worker.layers.context import set_attention_metadata
from worker.models.loader import LoadedModel

logger = logging.getLogger(__name__)


class SamplerLike(Protocol):
    def begin(self, requests: list[Request]) -> None: ...

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]: ...

    def rewind(self, request_id: str, num_rows: int) -> None: ...

    def release(self, request_ids: list[str]) -> None: ...


class ModelRunner:
    """Owns the KV cache; turns a SchedulerOutput into sampled tokens.

    Per step: flat ragged inputs (no padding), slot mapping from block tables, attention
    metadata in the per-step context, logits (the model's dtype, widened by the sampler where it
    needs float32) only at the last token of sampling
    chunks (at every position of a chunk with drafts), then the sampler and, for drafts,
    verification.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        sampler: SamplerLike,
        max_model_len: int | None = None,
        max_batch_size: int = 64,
        cuda_graphs: bool = True,
        compile_mode: CompileMode = "off",
        cache_dir: str | None = None,
        compile_threads: list[int] | None = None,
        native_forward: bool = True,
        row_attention: bool = False,
        num_local_blocks: int = 0,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.sampler = sampler
        # One block more than the block manager knows of: padded rows of a CUDA graph write
        # their K/V there.
        self.scratch_block = num_blocks
        # Sliding-window layers with a pool of their own (`num_local_blocks`; its extra block
        # is the local tables' null block and the local scratch block).
        local_layers = None
        if num_local_blocks:
            local_layers = [window is not None for window in window_layers(self.model)]
        self.kv_cache: KVCache = allocate_kv_cache(
            loaded.hf_config,
            num_blocks + 1,
            block_size,
            kv_dtype or loaded.dtype,
            loaded.device,
            local_layers,
            num_local_blocks + 1,
        )
        bind_kv_cache(self.model, self.kv_cache, loaded.dtype)
        # CPU, bf16: the forward on Ladle's native kernels where the model has one. It fuses
        # what inductor would, at less cost per call, so only LLM_COMPILE=on compiles then.
        use_native = getattr(self.model, "use_native", None)
        self.native_forward = bool(
            use_native and use_native(native_forward and compile_mode != "on")
        )
        # Every token attended as its own row (batch invariance): where every layer's cache
        # and heads are served by the native row kernel. Inductor would re-fuse the norms'
        # sums by shape, so an invariant forward is never compiled.
        self.row_attention = row_attention and _rows_supported(self.model)
        if self.row_attention and block_size % 16 == 0:
            # every token of every step is a row on the native kernel, the only reader of
            # its packed keys (a score per 16 keys without lane sums: attention.cpp)
            for layer in self.model.modules():
                if isinstance(layer, PagedAttention):
                    layer.packed_keys = True
                    # bf16 on the AMX tiles where `native` kept them (every row, all along)
                    layer.tiles = native.attention_tiles() and layer.k_cache.dtype == torch.bfloat16
            note_change()
        if self.native_forward or self.row_attention:
            compile_mode = "off"
        # CPU: the forward as an inductor program (None: eager); warmed up here, off the
        # request path.
        self.compiled = compile_forward(
            self.model,
            compile_mode,
            self.scratch_block,
            block_size,
            cache_dir,
            compile_threads,
            num_local_blocks if num_local_blocks else None,
        )
        self.forward = self.compiled or self.model
        self.graphs: DecodeGraphs | None = None
        # a sliding window's decode mask is built from context lengths a graph does not have
        if cuda_graphs and self.device.type == "cuda" and not _has_windows(self.model):
            self.graphs = DecodeGraphs(
                self.model,
                block_size,
                max_model_len or loaded.max_model_len,
                max_batch_size,
                self.scratch_block,
                self.device,
                CudaGraphBackend(self.device),
            )

    @torch.inference_mode()
    def compute_logits(self, scheduler_output: SchedulerOutput, widen: bool = True) -> torch.Tensor:
        """Float32 logits [S, vocab]: `num_sampled_rows` rows per chunk, in chunk order (`widen`
        False: in the model's dtype where the family allows, see its compute_logits)."""
        chunks = scheduler_output.chunks
        if self.graphs is not None and self.graphs.supports(chunks):
            try:
                hidden = self.graphs.run(chunks)
            except GraphCaptureError as exc:
                logger.error("CUDA graph capture failed (%s): decode runs eagerly from now on", exc)
                self.graphs = None
            else:
                sampling = [i for i, c in enumerate(chunks) if c.is_sampling]
                if len(sampling) < len(chunks):
                    hidden = hidden[torch.tensor(sampling, dtype=torch.long, device=self.device)]
                return self.model.compute_logits(hidden, widen)
        inputs = build_step_inputs(chunks, self.block_size, self.device, self.row_attention)
        set_attention_metadata(inputs.metadata)
        try:
            hidden = self.forward(inputs.input_ids, inputs.positions)
        finally:
            set_attention_metadata(None)
        return self.model.compute_logits(hidden[inputs.logits_indices], widen)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        chunks = [c for c in scheduler_output.chunks if c.is_sampling]
        # A chunk with k drafts has k + 1 rows, sampled exactly as k + 1 decode steps would be.
        rows = [c.request for c in chunks for _ in range(c.num_sampled_rows)]
        self.sampler.begin(rows)  # grammar masks are filled while the forward runs
        # the sampler widens them to float32 where it reads more than each row's argmax
        logits = self.compute_logits(scheduler_output, widen=False)
        if not chunks:
            return ModelRunnerOutput()
        sampled = self.sampler.sample(logits, rows)
        output = ModelRunnerOutput()
        row = 0
        for chunk in chunks:
            chunk_rows = sampled[row : row + chunk.num_sampled_rows]
            row += chunk.num_sampled_rows
            num_kept = accept_drafts(chunk.draft_token_ids, [s.token_id for s in chunk_rows])
            num_unused = len(chunk_rows) - (num_kept + 1)
            if num_unused:
                self.sampler.rewind(chunk.request.request_id, num_unused)
            output.sampled[chunk.request.request_id] = chunk_rows[: num_kept + 1]
        return output

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request sampler state (finished, aborted or preempted requests)."""
        self.sampler.release(request_ids)


def _rows_supported(model: torch.nn.Module) -> bool:
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    return bool(layers) and all(layer.native_rows for layer in layers)


def _has_windows(model: torch.nn.Module) -> bool:
    return any(
        isinstance(m, PagedAttention) and m.sliding_window is not None for m in model.modules()
    )

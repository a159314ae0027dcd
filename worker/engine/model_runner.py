"""Runs one engine step on the model: one batched forward over every scheduled token."""

from __future__ import annotations

from typing import Protocol

import torch

from worker.engine.attention_metadata import build_step_inputs
from worker.engine.kv_cache import KVCache, allocate_kv_cache, bind_kv_cache
from worker.engine.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from worker.engine.request import Request
from worker.layers.context import set_attention_metadata
from worker.layers.linear import prepack_linears
from worker.models.loader import LoadedModel


class SamplerLike(Protocol):
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]: ...

    def release(self, request_ids: list[str]) -> None: ...


class ModelRunner:
    """Owns the KV cache; turns a SchedulerOutput into sampled tokens.

    Per step: flat ragged inputs (no padding), slot mapping from block tables, attention
    metadata in the per-step context, logits (float32) only at the last token of sampling
    chunks, then the sampler.
    """

    def __init__(
        self, loaded: LoadedModel, num_blocks: int, block_size: int, sampler: SamplerLike
    ) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.sampler = sampler
        self.kv_cache: KVCache = allocate_kv_cache(
            loaded.hf_config, num_blocks, block_size, loaded.dtype, loaded.device
        )
        bind_kv_cache(self.model, self.kv_cache)
        # CPU bf16: weights reordered once for oneDNN (bitwise equal, faster small batches).
        self.num_prepacked = prepack_linears(self.model)

    @torch.inference_mode()
    def compute_logits(self, scheduler_output: SchedulerOutput) -> torch.Tensor:
        """Float32 logits [S, vocab], one row per sampling chunk, in chunk order."""
        inputs = build_step_inputs(scheduler_output.chunks, self.block_size, self.device)
        set_attention_metadata(inputs.metadata)
        try:
            hidden = self.model(inputs.input_ids, inputs.positions)
        finally:
            set_attention_metadata(None)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if scheduler_output.is_empty:
            return ModelRunnerOutput()
        logits = self.compute_logits(scheduler_output)
        requests = [c.request for c in scheduler_output.chunks if c.is_sampling]
        if not requests:
            return ModelRunnerOutput()
        sampled = self.sampler.sample(logits, requests)
        return ModelRunnerOutput(
            sampled={r.request_id: s for r, s in zip(requests, sampled, strict=True)}
        )

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request sampler state (finished, aborted or preempted requests)."""
        self.sampler.release(request_ids)

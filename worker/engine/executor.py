"""Executor: the model on its device, its KV cache sized from settings, runner and sampler.

The engine talks to this one object for everything that touches tensors.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Protocol

import torch

from worker.engine.autotune import KernelPlan, choose_kernels
from worker.engine.config import EngineConfig
from worker.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from worker.engine.kv_cache import (
    kv_bytes_per_block,
    per_layer_block_bytes,
    split_pools,
    window_layers,
)
from worker.engine.model_runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.threads import ThreadChooser
from worker.layers import native
from worker.layers.attention import PagedAttention
from worker.layers.linear import has_quantized_projections
from worker.models.loader import LoadedModel, load_model

logger = logging.getLogger(__name__)


def prefill_kind(num_tokens: int) -> str:
    """The thread chooser's kind for a step with prefill: by its tokens, to the next power of
    two (from 16). One kind for every size compared a 5-token tail's wall time with a
    1,024-token chunk's, so a probe that landed on a small step moved every prefill to one
    thread (seen in `llm_step_threads`, docs/benchmarks.md)."""
    bucket = 16
    while bucket < num_tokens:
        bucket *= 2
    return f"prefill<={bucket}"


class Executor(Protocol):
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int
    kv_bytes_per_block: int
    device: str
    dtype: str
    compiled: bool
    deterministic: bool
    deterministic_reason: str
    kernels: dict[str, str]

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def release(self, request_ids: list[str]) -> None: ...


class TorchExecutor:
    """Owns the loaded model, the KV cache and the model runner."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.loaded = loaded
        hf_config = loaded.hf_config
        self.max_model_len = min(loaded.max_model_len, config.max_model_len or 1 << 30)
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = list(loaded.eos_token_ids)
        self.kv_dtype = _kv_dtype(config, loaded)
        all_layers = kv_bytes_per_block(hf_config, config.block_size, self.kv_dtype)
        pools = split_pools(
            window_layers(loaded.model),
            _num_blocks(config, loaded, all_layers) * all_layers,
            per_layer_block_bytes(hf_config, config.block_size, self.kv_dtype),
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        self.num_blocks, self.kv_bytes_per_block = pools.num_blocks, pools.bytes_per_block
        # sliding-window layers' own pool (0: they share the full one) and its window
        self.num_local_blocks, self.sliding_window = pools.num_local_blocks, pools.window
        self.device = str(loaded.device)
        self.dtype = str(loaded.dtype).removeprefix("torch.")
        self.quantization = loaded.quantization  # as loaded: "auto" resolved per layer
        self.num_threads = torch.get_num_threads()
        self.native_kernels = native.configure(
            _wants_native(config, loaded.device.type, loaded.dtype), config.cache_dir
        )
        invariant = config.deterministic and loaded.device.type == "cpu" and self.native_kernels
        self.kernel_plan: KernelPlan = choose_kernels(
            loaded.model,
            config.linear_kernel,
            config.max_num_seqs,
            self.num_threads,
            config.cache_dir,
            invariant=invariant,
        )
        # Decode steps read every weight once for little arithmetic: memory-bound, they may
        # run as fast on fewer cores, leaving the rest to the API and Redis; and which count
        # is faster changes with the machine's load. Unless LLM_DECODE_THREADS fixes the
        # decode count, every kind of step (decode by batch bucket, prefill) picks 1 or all
        # threads from its own recent step times (`worker/engine/threads.py`), starting from
        # the kernel plan's measured choice, else all threads (faster on idle cores at 1 and
        # 16 sequences, docs/benchmarks.md; the first probe corrects it within a few steps).
        self.decode_threads = min(config.decode_threads or self.num_threads, self.num_threads)
        self._measured_threads = config.decode_threads is None
        self.threads = ThreadChooser(
            sorted({1, self.num_threads}) if self._measured_threads else [self.decode_threads],
            self._initial_threads,
        )
        self.runner = ModelRunner(
            loaded,
            self.num_blocks,
            config.block_size,
            Sampler(),
            max_model_len=self.max_model_len,
            max_batch_size=config.max_num_seqs,
            cuda_graphs=config.cuda_graphs,
            compile_mode=config.compile,  # type: ignore[arg-type]
            cache_dir=config.cache_dir,
            # Dynamo guards on the thread count: compile for every count a step may use.
            compile_threads=sorted({self.num_threads, *self._decode_thread_counts()}),
            native_forward=self.native_kernels,
            row_attention=invariant,
            num_local_blocks=self.num_local_blocks,
            kv_dtype=self.kv_dtype,
        )
        self.compiled = self.runner.compiled is not None
        self.deterministic_reason = _not_deterministic(config, self, loaded.device.type)
        self.deterministic = config.deterministic and not self.deterministic_reason
        if config.deterministic and self.deterministic_reason:
            logger.warning("batch-invariant mode not in use: %s", self.deterministic_reason)
        self.kernels = self.kernel_plan.summary()
        self.kernels["forward"] = (
            "native" if self.runner.native_forward else "compiled" if self.compiled else "eager"
        )
        self.kernels["kv_cache"] = str(self.kv_dtype).removeprefix("torch.")
        self._switch_threads = loaded.device.type == "cpu"
        logger.info(
            "kv cache: %d blocks of %d tokens in %s (%.1f MiB; sliding-window layers: %s), "
            "max_model_len %d, %s %s",
            self.num_blocks,
            config.block_size,
            self.kernels["kv_cache"],
            self.num_blocks * self.kv_bytes_per_block / 2**20,
            f"{self.num_local_blocks} blocks of their own" if self.num_local_blocks else "shared",
            self.max_model_len,
            self.device,
            self.dtype,
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if not self._switch_threads:
            return self.runner.execute(scheduler_output)
        chunks = scheduler_output.chunks
        if all(c.is_decode for c in chunks):
            rows = sum(c.num_tokens for c in chunks)  # drafts are rows too
            kind = f"decode<={self.kernel_plan.bucket_for(rows)}"
            threads = self.threads.pick(kind) if self._measured_threads else self.decode_threads
        else:
            kind = prefill_kind(sum(c.num_tokens for c in chunks))
            threads = self.threads.pick(kind) if self._measured_threads else self.num_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        output = self.runner.execute(scheduler_output)
        self.threads.record(kind, threads, time.perf_counter() - started)
        return output

    def _initial_threads(self, kind: str) -> int:
        """A kind's first choice: all threads for prefill; for decode the kernel plan's measured
        count, else what the nearest batch bucket already chose (the load that decided it is
        the same machine's), else the default."""
        if kind.startswith("prefill"):
            return self.num_threads
        rows = int(kind.removeprefix("decode<="))
        if self.kernel_plan.threads_for(rows) is None:
            seen = {
                int(other.removeprefix("decode<=")): threads
                for other, threads in self.threads.choices().items()
                if other.startswith("decode<=")
            }
            if seen:
                return seen[min(seen, key=lambda bucket: (abs(bucket - rows), -bucket))]
        return self.decode_threads_for(rows)

    def _decode_thread_counts(self) -> set[int]:
        if self._measured_threads:  # the chooser may run a decode step on any of its options
            return set(self.threads.options)
        return {self.decode_threads}

    def decode_threads_for(self, num_rows: int) -> int:
        """Threads a decode-only step of `num_rows` sequences starts on."""
        measured = self.kernel_plan.threads_for(num_rows) if self._measured_threads else None
        return min(measured or self.decode_threads, self.num_threads)

    def release(self, request_ids: list[str]) -> None:
        self.runner.release(request_ids)


def _num_blocks(config: EngineConfig, loaded: LoadedModel, bytes_per_block: int) -> int:
    if loaded.device.type == "cuda" and config.kv_cache_gpu_fraction:
        free_bytes, _total = torch.cuda.mem_get_info(loaded.device)
        budget = int(free_bytes * config.kv_cache_gpu_fraction)
    else:
        budget = config.kv_cache_size_mb * 2**20
    num_blocks = budget // bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"KV cache of {budget / 2**20:.1f} MiB holds fewer than 2 blocks "
            f"({bytes_per_block} bytes each): raise LLM_KV_CACHE_SIZE_MB"
        )
    return int(num_blocks)


def _kv_dtype(config: EngineConfig, loaded: LoadedModel) -> torch.dtype:
    """The KV cache's dtype (`LLM_KV_CACHE_DTYPE`): float16 for a float32 model only where the
    native row kernel, its one reader, attends every row of every layer (batch-invariant CPU
    mode); auto picks it where quantized projections already leave float32 parity."""
    if config.kv_cache_dtype == "model":
        return loaded.dtype
    served = (
        loaded.dtype == torch.float32
        and config.deterministic
        and _wants_native(config, loaded.device.type, loaded.dtype)
        and native.loaded()
    )
    layers = [m for m in loaded.model.modules() if isinstance(m, PagedAttention)]
    served = served and all(
        layer.rows_served(torch.float16, torch.float32, loaded.device) for layer in layers
    )
    if config.kv_cache_dtype == "float16":
        if not served:
            raise ValueError(
                "LLM_KV_CACHE_DTYPE=float16 needs a float32 model on the CPU's native row "
                "attention (LLM_DTYPE=float32 or auto on an AVX2 CPU, native kernels, "
                "LLM_DETERMINISTIC=true, a head shape the kernel serves)"
            )
        return torch.float16
    quantized = has_quantized_projections(loaded.model)
    return torch.float16 if served and quantized else loaded.dtype


def _wants_native(config: EngineConfig, device: str, dtype: torch.dtype) -> bool:
    """Ladle's native kernels serve bf16 and float32 compute on CPU (matmuls, quantized ones,
    attention, the small ops), and every dtype where batch invariance is asked for (only they
    promise it)."""
    serves = dtype in (torch.bfloat16, torch.float32) or config.deterministic
    return config.native_kernels and device in ("cpu", "auto") and serves


def _not_deterministic(config: EngineConfig, executor: TorchExecutor, device: str) -> str:
    """Why the engine is not batch invariant although `config.deterministic` asks ("": it is)."""
    if not config.deterministic:
        return "LLM_DETERMINISTIC=false"
    if device != "cpu":
        return f"no batch-invariant kernels on {device}"
    if not executor.native_kernels:
        return f"native kernels not in use ({native.status()})"
    if not executor.kernel_plan.invariant:
        return "a linear layer has no batch-invariant kernel (LLM_LINEAR_KERNEL or its shape)"
    if not executor.runner.row_attention:
        return "attention not served by the native row kernel (head shape, or soft-capped scores)"
    return ""


def configure_threads(num_threads: int | None) -> None:
    """One intra-op thread per core present (affinity-aware), unless configured."""
    if num_threads is None:
        num_threads = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
    torch.set_num_threads(num_threads)


def build_executor(config: EngineConfig) -> TorchExecutor:
    configure_threads(config.num_threads)
    # before loading: weight-only int4 packs its weights for the native kernel at load
    device = "cuda" if config.device == "auto" and torch.cuda.is_available() else config.device
    dtype = torch.float32 if config.dtype == "float32" else torch.bfloat16  # auto: bf16 or none
    native.configure(_wants_native(config, device, dtype), config.cache_dir)
    native.select_int4_kernel(config.int4_kernel)
    native.select_attention_kernel(config.attention_kernel)
    started = time.perf_counter()
    loaded = load_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        cache_dir=config.cache_dir,
        quantization=config.quantization,
        lm_head_quantization=config.lm_head_quantization,
    )
    logger.info("model %s loaded in %.2f s", config.model, time.perf_counter() - started)
    return TorchExecutor(config, loaded)

"""Engine configuration: the subset of settings the engine needs, usable without Redis."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import Settings


@dataclass
class EngineConfig:
    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "auto"
    quantization: str = "none"
    device: str = "auto"
    block_size: int = 16
    kv_cache_size_mb: int = 512
    kv_cache_gpu_fraction: float | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    cache_dir: str | None = None
    num_threads: int | None = None
    decode_threads: int | None = None
    cuda_graphs: bool = True
    speculative_ngram: int = 0
    speculative_ngram_size: int = 3

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        return cls(
            model=settings.model_name,
            dtype=settings.dtype,
            quantization=settings.quantization,
            device=settings.device,
            block_size=settings.block_size,
            kv_cache_size_mb=settings.kv_cache_size_mb,
            kv_cache_gpu_fraction=settings.kv_cache_gpu_fraction,
            max_num_seqs=settings.max_batch_size,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=settings.max_model_len,
            enable_prefix_caching=settings.enable_prefix_caching,
            cache_dir=settings.cache_dir,
            num_threads=settings.num_threads,
            decode_threads=settings.decode_threads,
            cuda_graphs=settings.cuda_graphs,
            speculative_ngram=settings.speculative_ngram,
            speculative_ngram_size=settings.speculative_ngram_size,
        )

"""Engine configuration: the settings the engine needs, under the engine's names.

`Settings` (`shared/config.py`) declares every value, its range and its default once. The
defaults here are read from those declarations, and `from_settings` copies a Settings
object field by field, so the offline engine and the worker start from the same values.
A new engine setting is a field on `Settings` and one `_setting()` line here;
`tests/unit/test_config.py` fails on a field that is here and not there.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shared.config import Settings

# EngineConfig name -> Settings name, where they differ (the engine keeps vLLM's names).
SETTING_NAMES = {"model": "model_name", "max_num_seqs": "max_batch_size"}


def _setting(name: str) -> Any:
    """A dataclass field whose default is the Settings field's declared default."""
    info = Settings.model_fields[SETTING_NAMES.get(name, name)]
    if info.default_factory is not None:
        return field(default_factory=info.default_factory)  # type: ignore[arg-type]
    return field(default=info.default)


@dataclass
class EngineConfig:
    model: str = _setting("model")
    dtype: str = _setting("dtype")
    quantization: str = _setting("quantization")
    lm_head_quantization: str = _setting("lm_head_quantization")
    device: str = _setting("device")
    block_size: int = _setting("block_size")
    kv_cache_size_mb: int = _setting("kv_cache_size_mb")
    kv_cache_dtype: str = _setting("kv_cache_dtype")
    kv_cache_gpu_fraction: float | None = _setting("kv_cache_gpu_fraction")
    max_num_seqs: int = _setting("max_num_seqs")
    max_num_batched_tokens: int = _setting("max_num_batched_tokens")
    max_model_len: int | None = _setting("max_model_len")
    enable_prefix_caching: bool = _setting("enable_prefix_caching")
    cache_dir: str | None = _setting("cache_dir")
    num_threads: int | None = _setting("num_threads")
    decode_threads: int | None = _setting("decode_threads")
    cuda_graphs: bool = _setting("cuda_graphs")
    speculative_ngram: int = _setting("speculative_ngram")
    speculative_ngram_size: int = _setting("speculative_ngram_size")
    compile: str = _setting("compile")
    linear_kernel: str = _setting("linear_kernel")
    int4_kernel: str = _setting("int4_kernel")
    attention_kernel: str = _setting("attention_kernel")
    native_kernels: bool = _setting("native_kernels")
    deterministic: bool = _setting("deterministic")

    @classmethod
    def from_settings(cls, settings: Settings) -> EngineConfig:
        """The worker's engine configuration: every field from `settings`."""
        return cls(
            **{f.name: getattr(settings, SETTING_NAMES.get(f.name, f.name)) for f in fields(cls)}
        )

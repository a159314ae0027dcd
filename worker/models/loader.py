"""Load a model by reference: the default name, a local HF directory, or a .gguf file.

A GGUF is converted once into an HF directory under the cache; later starts read that.
With quantization on, a GGUF's weights are read from the file itself instead, so that its
Q4_0/Q4_1/Q4_K blocks reach the int4 layers as they are (`gguf_quant.py`); "auto" (the
default) serves each tensor in the precision the file holds it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from shared.model_files import converted_dir, resolve_model
from worker.layers import native
from worker.layers.linear import Linear, head_sources, quantize_linears, quantize_lm_head
from worker.layers.quant import QuantizationUnavailable, QuantizedTensor, check_quantization
from worker.models.errors import ModelConfigError
from worker.models.gguf_convert import convert_gguf
from worker.models.gguf_quant import gguf_quantized_weights
from worker.models.registry import build_model, resolve_architecture
from worker.models.saved_config import read_config

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedWeights:
    """What every loaded model has, a generator or a pooling model."""

    model: nn.Module
    hf_config: Any
    model_dir: Path
    dtype: torch.dtype
    device: torch.device
    max_model_len: int


@dataclass
class LoadedModel(LoadedWeights):
    """A generator ready to run, and what the engine needs to know about it."""

    eos_token_ids: list[int]
    quantization: str = "none"


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_has_native_bf16() -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
    return bool({"avx512_bf16", "amx_bf16"} & set(flags.split()))


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto": bfloat16 on CUDA, and on CPUs with native bf16; float32 otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda" or cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def hf_dir_for(ref: str, cache_dir: str | None = None) -> Path:
    """The HF directory for `ref`, converting a GGUF on first use."""
    source = resolve_model(ref, cache_dir)
    if source.kind == "hf_dir":
        return source.path
    target = converted_dir(source, cache_dir)
    if (target / "model.safetensors").exists():
        return target
    started = time.perf_counter()
    convert_gguf(source.path, target)
    log.info(
        "converted GGUF %s to %s in %.1fs", source.path.name, target, time.perf_counter() - started
    )
    return target


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                yield name, handle.get_tensor(name)


def eos_token_ids(model_dir: Path, config: Any) -> list[int]:
    """eos ids from generation_config.json when present, else from config."""
    value = getattr(config, "eos_token_id", None)
    generation = model_dir / "generation_config.json"
    if generation.exists():
        value = json.loads(generation.read_text()).get("eos_token_id", value)
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    ref: str,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    max_model_len: int | None = None,
    quantization: str = "none",
    lm_head_quantization: str = "none",
) -> LoadedModel:
    """Build our model for `ref` and load its weights onto `device` in `dtype`.

    `quantization` "int8"/"int4" makes every projection but the lm_head weight-only
    quantized (`worker/layers/quant.py`); embeddings and norms keep `dtype`, and so does the
    lm_head unless `lm_head_quantization` makes it int8 (`quantize_lm_head`).
    "auto" follows a GGUF's own types (`resolve_quantization`).
    """
    started = time.perf_counter()
    model_dir = hf_dir_for(ref, cache_dir)
    config = _read_config(model_dir, cache_dir)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    check_quantization(quantization, torch_device)
    quantization = resolve_quantization(
        quantization, ref, torch_device, torch_dtype, dtype_auto=dtype == "auto"
    )
    model_len = _max_model_len(config, max_model_len)
    with _default_dtype(torch_dtype), torch.device("meta"):
        model = build_model(config, model_len)
    materialize(model, torch_device)
    with torch.no_grad():
        weights = _checkpoint(ref, model_dir, config, quantization)
        sources: dict[str, torch.Tensor] = {}
        if lm_head_quantization != "none":  # the head quantizes from the checkpoint's values
            weights = head_sources(weights, sources)
        model.load_weights(weights)
        if quantization != "none":
            quantize_linears(model, quantization)
            quantization = precision_label(model, quantization)
        lm_head = "int8" if quantize_lm_head(model, lm_head_quantization, sources) else None
        sources.clear()
        model.post_load()
    model.eval()
    log_loaded(
        model_dir,
        started,
        type(model).__name__,
        torch_dtype,
        f"quantization {quantization}",
        f"lm_head {lm_head or torch_dtype}",
        torch_device,
    )
    return LoadedModel(
        model=model,
        hf_config=config,
        model_dir=model_dir,
        dtype=torch_dtype,
        device=torch_device,
        max_model_len=model_len,
        eos_token_ids=eos_token_ids(model_dir, config),
        quantization=quantization,
    )


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """`model.to_empty(device=device)` without `empty_like` of meta tensors, whose Python
    meta kernels import sympy and torch's decompositions (0.4-0.6 s of every start)."""
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))


def log_loaded(model_dir: Path, started: float, *details: object) -> None:
    """One line a load, for a generator or a pooling model: from where, as what, how long."""
    described = ", ".join(str(detail) for detail in details)
    log.info("loaded %s (%s) in %.1fs", model_dir, described, time.perf_counter() - started)


def resolve_quantization(
    mode: str, ref: str, device: torch.device, dtype: torch.dtype, dtype_auto: bool = False
) -> str:
    """ "auto": per tensor as the GGUF holds it (`gguf_quant.AUTO_MODES`) where the quantized
    kernels serve it: CPU with bf16 compute, or float32 that `LLM_DTYPE=auto` chose on a CPU
    without AVX512-BF16 where Ladle's int4 kernel on float32 activations (AVX2) loaded; "none"
    for float checkpoints, other devices, or a float32/float16 model its user asked for."""
    if mode != "auto":
        return mode
    gguf = resolve_model(ref).kind == "gguf"
    float32_int4 = dtype == torch.float32 and dtype_auto and native.int4_f32_packable(16, 32, 32)
    if not (gguf and device.type == "cpu" and (dtype == torch.bfloat16 or float32_int4)):
        return "none"
    try:
        for needed in ("int4", "int8"):
            check_quantization(needed, device)
    except QuantizationUnavailable:
        return "none"
    return "auto"


def precision_label(model: nn.Module, mode: str) -> str:
    """What the projections are served in: `mode`, or for "auto" the count per mode."""
    if mode != "auto":
        return mode
    counts = Counter(
        module.quantized.name.split("-")[0]
        for name, module in model.named_modules()
        if isinstance(module, Linear) and module.quantized is not None and name != "lm_head"
    )
    parts = [f"{name} x {count}" for name, count in sorted(counts.items())]
    return f"auto ({', '.join(parts) or 'none'})"


def _read_config(model_dir: Path, cache_dir: str | None) -> Any:
    """The model's transformers config (as a previous start saved it, `saved_config.py`),
    checked against the registry before transformers reads it (so an unknown or
    remote-code architecture is one clear `ModelConfigError`)."""
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelConfigError(f"{model_dir} has no config.json")
    resolve_architecture(json.loads(path.read_text()))
    return read_config(model_dir, cache_dir, lambda: _read_live_config(model_dir))


def _read_live_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelConfigError(f"cannot read {model_dir / 'config.json'}: {first_line}") from exc


def _checkpoint(
    ref: str, model_dir: Path, config: Any, quantization: str
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """The weights to load: a quantized GGUF's own blocks when quantizing, else safetensors."""
    source = resolve_model(ref)
    if quantization != "none" and source.kind == "gguf":  # its own blocks, never via bf16
        return gguf_quantized_weights(source.path, config.to_dict(), quantization, model_dir)
    return iter_safetensors(model_dir)


def _max_model_len(config: Any, cap: int | None) -> int:
    length = int(getattr(config, "max_position_embeddings", 0) or 2048)
    return min(length, cap) if cap else length

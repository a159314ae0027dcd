"""Load an embedding model or a cross-encoder from a local HF / sentence-transformers
directory, with what the embedding engine needs to know about it (pooling, context, task)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn

from worker.models.loader import (
    LoadedWeights,
    hf_dir_for,
    iter_safetensors,
    log_loaded,
    materialize,
    resolve_device,
    resolve_dtype,
)
from worker.models.registry import build_pooling_model, pooling_architecture
from worker.models.sentence_config import PoolingConfig, read_pooling_config, transformer_dir

log = logging.getLogger(__name__)

Task = Literal["embed", "score"]


@dataclass
class LoadedPoolingModel(LoadedWeights):
    """A model that turns whole inputs into vectors (`embed`) or relevance scores (`score`)."""

    weights_dir: Path
    task: Task
    pooling: PoolingConfig
    hidden_size: int
    # a cross-encoder's activation on its logit (sentence-transformers' CrossEncoder default)
    score_activation: Literal["sigmoid", "identity"] = "sigmoid"


def is_pooling_model(ref: str, cache_dir: str | None = None) -> bool:
    """Whether `ref` names an embedding model or cross-encoder (rather than a generator).

    Only `architectures` and `model_type` decide, so they are read from config.json itself:
    `AutoConfig` imports transformers' model machinery, ~1 s of every worker's start."""
    model_dir = hf_dir_for(ref, cache_dir)
    is_st = (model_dir / "modules.json").exists()
    config_dir = transformer_dir(model_dir)
    try:
        values = json.loads((config_dir / "config.json").read_text())
    except (OSError, ValueError):
        values = None
    if isinstance(values, dict) and values.get("model_type"):
        config: Any = SimpleNamespace(
            architectures=values.get("architectures"), model_type=values["model_type"]
        )
    else:  # let transformers say what it is, or why not
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(str(config_dir), local_files_only=True)
    return pooling_architecture(config, is_st) is not None


def load_pooling_model(
    ref: str,
    dtype: str | torch.dtype = "auto",
    device: str = "auto",
    cache_dir: str | None = None,
    max_model_len: int | None = None,
) -> LoadedPoolingModel:
    """Build our model for `ref` and load its weights onto `device` in `dtype`."""
    from transformers import AutoConfig

    started = time.perf_counter()
    model_dir = hf_dir_for(ref, cache_dir)
    weights_dir = transformer_dir(model_dir)
    config = AutoConfig.from_pretrained(str(weights_dir), local_files_only=True)
    architecture = pooling_architecture(config, (model_dir / "modules.json").exists())
    if architecture is None:
        raise ValueError(f"{model_dir} is not an embedding or cross-encoder model")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    model = _built(config, architecture, weights_dir, torch_device, torch_dtype)
    pooling = read_pooling_config(model_dir, config.to_dict(), model.is_causal)
    log_loaded(model_dir, started, architecture, torch_dtype, torch_device)
    return LoadedPoolingModel(
        model=model,
        hf_config=config,
        model_dir=model_dir,
        weights_dir=weights_dir,
        dtype=torch_dtype,
        device=torch_device,
        max_model_len=_max_model_len(config, model, pooling, max_model_len),
        task="score" if model.num_labels else "embed",
        pooling=pooling,
        hidden_size=int(config.hidden_size),
        score_activation=_score_activation(config, model.num_labels),
    )


def _built(
    config: Any, architecture: str, weights_dir: Path, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    with torch.device("meta"):  # no random init: every weight comes from the checkpoint
        model = build_pooling_model(config, architecture, int(config.max_position_embeddings))
    with torch.no_grad():
        materialize(model, device).to(dtype)
        model.load_weights(checkpoint_tensors(weights_dir))
        model.post_load()
    return model.eval()


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """safetensors where present, else `pytorch_model.bin` read as plain tensors only."""
    if any(model_dir.glob("*.safetensors")):
        return iter_safetensors(model_dir)
    legacy = model_dir / "pytorch_model.bin"
    if not legacy.exists():
        raise FileNotFoundError(f"no *.safetensors or pytorch_model.bin in {model_dir}")
    return iter(torch.load(legacy, map_location="cpu", weights_only=True).items())


def _max_model_len(config: Any, model: nn.Module, pooling: PoolingConfig, cap: int | None) -> int:
    """Positions the model has (RoBERTa's start after the padding id), capped by the
    sentence-transformers `max_seq_length` (as vLLM does) and by `cap`."""
    offset = getattr(getattr(model, "embeddings", None), "position_offset", 0)
    length = int(config.max_position_embeddings) - offset
    for limit in (pooling.max_seq_length, cap):
        if limit:
            length = min(length, int(limit))
    return length


def _score_activation(config: Any, num_labels: int) -> Literal["sigmoid", "identity"]:
    """sentence-transformers' rule: the saved `activation_fn`, else sigmoid for one label."""
    saved = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn")
    if saved:
        return "sigmoid" if saved.endswith("Sigmoid") else "identity"
    return "sigmoid" if num_labels == 1 else "identity"

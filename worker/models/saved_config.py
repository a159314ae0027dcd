"""A model's transformers config, read once through transformers and then kept as plain values.

transformers 5's config classes import its model-loading machinery, and that imports
torch.distributed's tensor ops: about a second of every start (docs/benchmarks.md,
"Start-up"). So the first read of a `config.json` goes through `AutoConfig`, and every public
attribute it then has (defaults and derived values included) whose value survives JSON is
saved under `{cache}/configs/`; later starts read a `SavedConfig` from there, the same values
by the same names. An attribute that was left out (not JSON) fails loudly when read, rather
than looking absent. The key holds the file's bytes, its directory and transformers' version.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

from shared.model_files import cache_root

log = logging.getLogger(__name__)
FORMAT = 1


class SavedConfig:
    """The attributes of a transformers config, and its `to_dict()`."""

    def __init__(self, attributes: dict[str, Any], as_dict: dict[str, Any], left_out: list[str]):
        self.__dict__.update(attributes)
        self._as_dict = as_dict
        self._left_out = frozenset(left_out)

    def __getattr__(self, name: str) -> Any:  # only for names not set in __init__
        if name in self.__dict__.get("_left_out", ()):
            raise TypeError(f"config attribute {name!r} was not saved (not JSON); read it live")
        raise AttributeError(name)

    def to_dict(self) -> dict[str, Any]:
        return json.loads(json.dumps(self._as_dict))


def read_config(model_dir: Path, cache_dir: str | None, read_live: Any) -> Any:
    """`model_dir`'s config: saved values where a start saved them, else `read_live()`
    (transformers' AutoConfig), saved for the next start."""
    path = _saved_path(model_dir, cache_dir)
    try:
        saved = json.loads(path.read_text())
        return SavedConfig(saved["attributes"], saved["dict"], saved["left_out"])
    except (OSError, ValueError, KeyError):
        pass
    config = read_live()
    try:
        _save(path, config)
    except (OSError, TypeError, ValueError) as exc:  # the next start reads it live again
        log.debug("config of %s not saved: %r", model_dir, exc)
    return config


def plain_attributes(config: Any) -> tuple[dict[str, Any], list[str]]:
    """Every public, non-callable attribute of `config` whose value JSON keeps as it is, and
    the names of those it would not."""
    kept, left_out = {}, []
    quiet = logging.getLogger("transformers")  # deprecated aliases log when read
    level = quiet.level
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # and warn
        quiet.setLevel(logging.ERROR)
        try:
            for name in dir(config):
                if name.startswith("_"):
                    continue
                try:
                    value = getattr(config, name)
                except Exception:  # noqa: BLE001  (a property that cannot answer: not kept)
                    left_out.append(name)
                    continue
                if callable(value):
                    continue
                if _survives_json(value):
                    kept[name] = value
                else:
                    left_out.append(name)
        finally:
            quiet.setLevel(level)
    return kept, left_out


def _survives_json(value: Any) -> bool:
    try:
        return json.loads(json.dumps(value)) == value and _same_types(value)
    except (TypeError, ValueError):
        return False


def _same_types(value: Any) -> bool:
    """No tuples (they come back as lists) and no non-string keys anywhere in `value`."""
    if isinstance(value, tuple):
        return False
    if isinstance(value, list):
        return all(_same_types(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _same_types(v) for k, v in value.items())
    return True


def _save(path: Path, config: Any) -> None:
    attributes, left_out = plain_attributes(config)
    body = json.dumps({"attributes": attributes, "dict": config.to_dict(), "left_out": left_out})
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    with os.fdopen(handle, "w") as file:
        file.write(body)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)  # atomic: a concurrent start reads the old state or this one


def _saved_path(model_dir: Path, cache_dir: str | None) -> Path:
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    digest.update(f"{model_dir.resolve()}\0{version('transformers')}\0{FORMAT}".encode())
    return cache_root(cache_dir) / "configs" / f"{digest.hexdigest()[:32]}.json"

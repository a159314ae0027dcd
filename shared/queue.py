"""arq's job (de)serializer: JSON bytes, never pickle. The API and the worker use the same pair."""

from __future__ import annotations

import json
from typing import Any

RUN_COMPLETION = "run_completion"


def _fallback(obj: Any) -> Any:
    # arq stores a failed job's exception in its result record; keep its text, not the object.
    if isinstance(obj, BaseException):
        return f"{type(obj).__name__}: {obj}"
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    return str(obj)


def serialize_job(obj: Any) -> bytes:
    """Serialise an arq job or result dict to compact JSON bytes."""
    return json.dumps(obj, separators=(",", ":"), default=_fallback).encode()


def deserialize_job(data: bytes | str) -> Any:
    """Inverse of `serialize_job`."""
    return json.loads(data)

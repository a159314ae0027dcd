"""Integer handles for Python objects that custom ops call back into (kernels, attention).

A compiled graph can carry an int but not an arbitrary object (nor mkldnn's opaque weight
tensors); the op's implementation turns the handle back into the object. Weak references:
a dropped model frees its kernels and caches.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_OBJECTS: dict[int, weakref.ReferenceType] = {}
_NEXT = itertools.count()


def handle_of(obj: Any) -> int:
    """A new handle for `obj`, valid while `obj` lives."""
    handle = next(_NEXT)
    _OBJECTS[handle] = weakref.ref(obj, lambda _ref, h=handle: _OBJECTS.pop(h, None))
    return handle


def resolve(handle: int) -> Any:
    """The object behind `handle`; RuntimeError once it is gone."""
    ref = _OBJECTS.get(handle)
    obj = None if ref is None else ref()
    if obj is None:
        raise RuntimeError(f"handle {handle} no longer refers to a live object")
    return obj

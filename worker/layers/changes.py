"""A count of changes to how layers compute: a kernel chosen, a cache bound, native kernels
turned on or off. What is built from a model's layers once (the native stack,
`worker/models/native_stack.py`) is rebuilt when the count moved, at the cost of one int
comparison per step instead of walking every layer."""

from __future__ import annotations

_count = 0


def note_change() -> None:
    """Say that some layer's kernel, cache or native choice changed."""
    global _count
    _count += 1


def num_changes() -> int:
    return _count

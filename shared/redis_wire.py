"""Commands packed into Redis's wire format in C, for the asyncio clients too.

redis-py's blocking client packs with hiredis when it is installed; its asyncio client always
packs in Python, and the publisher packs an XADD for every token (docs/benchmarks.md, "Zen 5,
a day later": a fifth of the publisher's CPU a token). `pack_in_c()` gives every asyncio
connection of the process the blocking client's packer: the same bytes for the same arguments
(tests/unit/test_redis_wire.py).
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.connection import AbstractConnection
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

_SERIALIZER = HiredisRespSerializer()
PYTHON_PACK_COMMAND = AbstractConnection.pack_command  # redis-py's own (what tests compare with)


def _pack_command(_connection: AbstractConnection, *args: Any) -> list[bytes]:
    return _SERIALIZER.pack(*args)


def pack_in_c() -> bool:
    """Install the C packer on asyncio connections (idempotent); False without hiredis."""
    if not HIREDIS_AVAILABLE:
        return False
    AbstractConnection.pack_command = _pack_command  # type: ignore[method-assign]
    return True

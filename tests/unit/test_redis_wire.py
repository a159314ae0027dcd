"""The C packer installed on asyncio connections sends the bytes redis-py's own would."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import AbstractConnection, Connection
from redis.utils import HIREDIS_AVAILABLE

from shared import redis_wire

COMMANDS = [
    ("XADD", "ladle:stream:j1", "MAXLEN", "~", 1000, "*", "data", b'{"type":"delta"}'),
    ("SET", "ladle:job:é", "värde", "EX", 3600, "NX"),
    ("ZADD", "arq:queue", 1700000000123, "job-1"),
    ("ZADD", "scores", 0.1, "a", -2.5e-7, "b"),
    ("CLIENT SETNAME", "ladle-worker"),
    ("XREAD", "BLOCK", 50, "STREAMS", "s1", "s2", "0-0", "17-3"),
    ("SET", "big", b"x" * 100_000),
]


@pytest.mark.skipif(not HIREDIS_AVAILABLE, reason="hiredis is not installed")
def test_the_c_packer_sends_what_redis_py_packs_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    connection = Connection()
    packed = [b"".join(redis_wire.PYTHON_PACK_COMMAND(connection, *c)) for c in COMMANDS]
    monkeypatch.setattr(AbstractConnection, "pack_command", redis_wire.PYTHON_PACK_COMMAND)
    assert redis_wire.pack_in_c()
    assert AbstractConnection.pack_command is not redis_wire.PYTHON_PACK_COMMAND
    assert [b"".join(connection.pack_command(*c)) for c in COMMANDS] == packed
    assert b"".join(connection.pack_commands(COMMANDS)) == b"".join(packed)

"""Finding a Redis for `ladle up`: the configured one, a private redis-server, or an embedded one.

The order is fixed and each choice is logged loudly, because it decides whether jobs survive
a restart: (a) whatever answers PING at the configured URL; (b) a private `redis-server` on a
spare local port with persistence off, stopped on exit; (c) fakeredis's TCP server in a thread,
for trying Ladle out on a machine without Redis (not for production).
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import redis

from shared.logging import safe_url

logger = logging.getLogger("ladle.broker")

BrokerKind = Literal["configured", "private-redis-server", "embedded"]
LOCALHOST = "127.0.0.1"
# A tiny script that exercises what the worker's final-state compare-and-set needs.
_LUA_PROBE = "redis.call('SET', KEYS[1], ARGV[1]); return redis.call('GET', KEYS[1])"


class BrokerError(RuntimeError):
    """No usable Redis could be found or started."""


@dataclass
class BrokerHandle:
    """A Redis the service can use; `stop()` ends it if the launcher started it."""

    url: str
    kind: BrokerKind
    _stop: Callable[[], None] = field(default=lambda: None, repr=False)

    def stop(self) -> None:
        """Stop the broker if this process started it (idempotent)."""
        stop, self._stop = self._stop, lambda: None
        stop()


def ping(url: str, timeout_s: float = 1.0) -> bool:
    """True if a Redis server answers PING at `url` within the timeout."""
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def spare_port(host: str = LOCALHOST) -> int:
    """A TCP port that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str | None:
    """The path of `redis-server`, if installed."""
    return shutil.which("redis-server")


def lua_works(url: str) -> bool:
    """True if the server at `url` runs Lua scripts (EVAL and EVALSHA)."""
    client = redis.Redis.from_url(url, socket_timeout=2.0)
    try:
        script = client.register_script(_LUA_PROBE)
        return script(keys=["ladle:broker-probe"], args=["ok"]) == b"ok"
    except redis.RedisError:
        return False
    finally:
        client.delete("ladle:broker-probe")
        client.close()


def start_private_redis(binary: str, startup_timeout_s: float = 10.0) -> BrokerHandle:
    """Start `redis-server` on a spare 127.0.0.1 port, persistence off, data in a temp dir."""
    data_dir = tempfile.TemporaryDirectory(prefix="ladle-redis-")
    port = spare_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            LOCALHOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            data_dir.name,
            "--protected-mode",
            "yes",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C must not stop it while workers drain
    )
    url = f"redis://{LOCALHOST}:{port}/0"

    def stop() -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        data_dir.cleanup()

    deadline = time.monotonic() + startup_timeout_s
    while not ping(url, timeout_s=0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop()
            raise BrokerError(f"{binary} did not start on port {port}")
        time.sleep(0.05)
    return BrokerHandle(url, "private-redis-server", stop)


def _add_info_command() -> None:
    """Give fakeredis a minimal INFO: arq's worker logs `INFO server/memory/clients` at start."""
    from fakeredis._commands import SUPPORTED_COMMANDS, command
    from fakeredis._socket._fakesocket import FakeSocket

    if "info" in SUPPORTED_COMMANDS:
        return

    def info(self: FakeSocket, *sections: bytes) -> bytes:
        version = ".".join(str(part) for part in self._server.version)
        return (
            f"# Server\r\nredis_version:{version}\r\nredis_mode:standalone\r\n"
            "# Memory\r\nused_memory:0\r\nused_memory_human:0B\r\n"
            "# Clients\r\nconnected_clients:1\r\n"
        ).encode()

    FakeSocket.info = command((), (bytes,))(info)


def start_embedded_broker() -> BrokerHandle:
    """fakeredis's TCP server on a spare 127.0.0.1 port, served from a daemon thread."""
    try:
        from fakeredis import TcpFakeServer
    except ImportError as exc:
        raise BrokerError("no Redis found and fakeredis is not installed") from exc
    try:
        _add_info_command()
    except (ImportError, AttributeError) as exc:  # fakeredis internals moved: arq logs an error
        logger.warning("could not add INFO to the embedded broker: %s", exc)
    server = TcpFakeServer((LOCALHOST, 0), server_type="redis")
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="ladle-embedded-redis", daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    url = f"redis://{host}:{port}/0"

    def stop() -> None:
        server.shutdown()
        server.server_close()

    if not lua_works(url):
        stop()
        raise BrokerError(
            "the embedded broker cannot run Lua scripts, which the worker needs: "
            "`pip install lupa`, or run Redis and set LLM_REDIS_URL"
        )
    return BrokerHandle(url, "embedded", stop)


def find_or_start_redis(url: str, *, allow_start: bool = True) -> BrokerHandle:
    """Use the Redis at `url` if it answers, else start a private or an embedded one."""
    if ping(url):
        logger.warning("BROKER: using the configured Redis at %s", safe_url(url))
        return BrokerHandle(url, "configured")
    if not allow_start:
        raise BrokerError(f"no Redis answers at {safe_url(url)}")
    logger.warning("BROKER: nothing answers at %s; starting one for this run", safe_url(url))
    binary = redis_server_binary()
    if binary:
        handle = start_private_redis(binary)
        logger.warning(
            "BROKER: started a private redis-server (%s) at %s; persistence off, stopped on exit",
            binary,
            handle.url,
        )
        return handle
    handle = start_embedded_broker()
    logger.warning(
        "BROKER: no redis-server binary; started an EMBEDDED broker (fakeredis) at %s. "
        "It is for trying Ladle out, NOT for production: in-memory, single process, "
        "slower. Run Redis and set LLM_REDIS_URL for real use.",
        handle.url,
    )
    return handle

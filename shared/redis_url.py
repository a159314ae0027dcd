"""`LLM_REDIS_URL` -> Redis clients, parsed the same way for the API, the workers and arq.

arq's own `RedisSettings.from_dsn` neither percent-decodes the password (`p%40ss` stays
`p%40ss`) nor reads query options (`?ssl_cert_reqs=none&ssl_ca_certs=...`), while the API's
redis-py pool does both; this keeps the worker and the API reading one URL the same way.
Supported: `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS),
`unix:///path?db=N`, and Redis Sentinel:
`redis+sentinel://[[user]:password@]host:port[,host:port...]/MASTER[/db]` (`rediss+sentinel`
for TLS; `?sentinel_password=...` when the sentinels have their own). With Sentinel every
connection asks the sentinels for the current primary, so a failover is a reconnect.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from arq.connections import RedisSettings
from redis.asyncio.connection import SSLConnection, parse_url

from shared.logging import safe_url

_SSL_OPTIONS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data")
PLAIN_SCHEMES = ("redis", "rediss", "unix")
SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
DEFAULT_SENTINEL_PORT = 26379
# A sentinel that does not answer within this is skipped for the next one in the list.
SENTINEL_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class SentinelTarget:
    """A `redis+sentinel://` URL: where the sentinels are and which primary to ask for."""

    sentinels: list[tuple[str, int]]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False
    options: dict[str, str] = field(default_factory=dict)


def check_url(url: str) -> None:
    """Raise ValueError with one clear line if `url` is not a Redis URL Ladle can use."""
    scheme = urlsplit(url).scheme
    if scheme in SENTINEL_SCHEMES:
        parse_sentinel_url(url)
    elif scheme in PLAIN_SCHEMES:
        parse_url(url)
    else:
        known = ", ".join(f"{s}://" for s in (*PLAIN_SCHEMES, *SENTINEL_SCHEMES))
        raise ValueError(f"LLM_REDIS_URL has an unknown scheme {scheme!r}: use one of {known}")


def is_sentinel(url: str) -> bool:
    return urlsplit(url).scheme in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """`redis+sentinel://[user:pass@]h1:p1,h2:p2/MASTER[/db][?sentinel_password=...]`."""
    parts = urlsplit(url)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = [_host_port(item) for item in hosts.split(",") if item]
    path = [unquote(piece) for piece in parts.path.split("/") if piece]
    if not sentinels or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(
            f"a Sentinel URL is {parts.scheme}://host:port[,host:port...]/MASTER[/db], "
            f"got {safe_url(url)!r}"
        )
    options = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return SentinelTarget(
        sentinels=sentinels,
        master=path[0],
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=options.pop("sentinel_password", None),
        ssl=parts.scheme == "rediss+sentinel",
        options=options,
    )


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":") if ":" in text else (text, "", "")
    if port and not port.isdigit():
        raise ValueError(f"not host:port in a Sentinel URL: {text!r}")
    return host.strip("[]"), int(port or DEFAULT_SENTINEL_PORT)


def _connection_kwargs(target: SentinelTarget) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"db": target.db, "username": target.username}
    kwargs["password"] = target.password
    if target.ssl:
        kwargs["ssl"] = True
        kwargs.update({k: v for k, v in target.options.items() if k in _SSL_OPTIONS})
    return kwargs


def _sentinel_kwargs(target: SentinelTarget) -> dict[str, Any]:
    return {
        "password": target.sentinel_password,
        "socket_timeout": SENTINEL_TIMEOUT_S,
        "socket_connect_timeout": SENTINEL_TIMEOUT_S,
    }


def async_pool(url: str, **kwargs: Any) -> redis.asyncio.ConnectionPool:
    """An asyncio connection pool for `url`; connects lazily (nothing happens until used)."""
    if not is_sentinel(url):
        return redis.asyncio.ConnectionPool.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    manager = redis.asyncio.sentinel.Sentinel(
        target.sentinels, sentinel_kwargs=_sentinel_kwargs(target)
    )
    return redis.asyncio.sentinel.SentinelConnectionPool(
        target.master, manager, **_connection_kwargs(target), **kwargs
    )


def sync_client(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client for `url` (launcher, supervisor, tools)."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **kwargs)
    target = parse_sentinel_url(url)
    manager = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=_sentinel_kwargs(target))
    return manager.master_for(target.master, **_connection_kwargs(target), **kwargs)


def arq_redis_settings(url: str, **overrides: Any) -> RedisSettings:
    """RedisSettings for `url` (host, port, db, user, password, TLS and its options; for a
    Sentinel URL the sentinels and the primary's name)."""
    if is_sentinel(url):
        target = parse_sentinel_url(url)
        values: dict[str, Any] = {
            "host": target.sentinels,
            "sentinel": True,
            "sentinel_master": target.master,
            "database": target.db,
            "username": target.username,
            "password": target.password,
            "ssl": target.ssl,
        }
        values.update(overrides)
        return RedisSettings(**values)
    parsed = parse_url(url)
    values = {
        "host": parsed.get("host", "localhost"),
        "port": int(parsed.get("port") or 6379),
        "unix_socket_path": parsed.get("path"),
        "database": int(parsed.get("db") or 0),
        "username": parsed.get("username"),
        "password": parsed.get("password"),
        "ssl": parsed.get("connection_class") is SSLConnection,
    }
    for option in _SSL_OPTIONS:
        if option in parsed:
            values[option] = parsed[option]
    if "ssl_check_hostname" in parsed:
        values["ssl_check_hostname"] = bool(parsed["ssl_check_hostname"])
    values.update(overrides)
    return RedisSettings(**values)

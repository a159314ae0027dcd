"""`LLM_REDIS_URL` -> arq's RedisSettings, parsed the way redis-py parses it.

arq's own `RedisSettings.from_dsn` neither percent-decodes the password (`p%40ss` stays
`p%40ss`) nor reads query options (`?ssl_cert_reqs=none&ssl_ca_certs=...`), while the API's
redis-py pool does both; this keeps the worker and the API reading one URL the same way.
Supported: `redis://[[user]:password@]host[:port][/db]`, `rediss://...` (TLS) and
`unix:///path?db=N`.
"""

from __future__ import annotations

from typing import Any

from arq.connections import RedisSettings
from redis.asyncio.connection import SSLConnection, parse_url

_SSL_OPTIONS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_data")


def arq_redis_settings(url: str, **overrides: Any) -> RedisSettings:
    """RedisSettings for `url` (host, port, db, user, password, TLS and its options)."""
    parsed = parse_url(url)
    values: dict[str, Any] = {
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

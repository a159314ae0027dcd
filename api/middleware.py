"""Pure ASGI middlewares: request ids, metrics and the last-resort 500; the body size limit."""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.errors import error_body
from shared.logging import job_id_var, request_id_var
from shared.metrics import ApiMetrics

log = logging.getLogger("api.access")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


async def send_json(send: Send, status: int, body: dict, headers: list | None = None) -> None:
    data = json.dumps(body).encode()
    raw_headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
    ] + (headers or [])
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": data})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _quota_headers(scope: Scope, present: list) -> list[tuple[bytes, bytes]]:
    """The caller's `x-ratelimit-*` headers (`api/auth.py`), unless the response has them."""
    quota = scope.get("state", {}).get("quota")
    if quota is None:
        return []
    names = {name.lower() for name, _ in present}
    return [
        (name.encode(), value.encode())
        for name, value in quota.headers.items()
        if name.encode() not in names
    ]


class RequestContextMiddleware:
    """X-Request-Id in and out, log context, request metrics, JSON 500 for real bugs."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = _header(scope, b"x-request-id")
        request_id = given if given and _REQUEST_ID.match(given) else "req-" + secrets.token_hex(8)
        rid_token, job_token = request_id_var.set(request_id), job_id_var.set(None)
        state: dict[str, Any] = {"status": 500, "started": False}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                state["status"], state["started"] = message["status"], True
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                    *_quota_headers(scope, message.get("headers", [])),
                ]
            await send(message)

        start = time.perf_counter()
        self.metrics.active_requests.inc()
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("unhandled error")
            if not state["started"]:
                body = error_body("Internal server error", "server_error")
                await send_json(send_with_id, 500, body)
        finally:
            self.metrics.active_requests.dec()
            self._record(scope, state["status"], time.perf_counter() - start)
            request_id_var.reset(rid_token)
            job_id_var.reset(job_token)

    def _record(self, scope: Scope, status: int, duration: float) -> None:
        route = scope.get("route")
        endpoint = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
        self.metrics.request_duration.labels(endpoint=endpoint).observe(duration)
        extra = {
            "method": scope.get("method"),
            "path": scope.get("path"),
            "status": status,
            "duration_ms": round(duration * 1000, 2),
        }
        key_id = scope.get("state", {}).get("api_key_id")
        if key_id:
            extra["api_key_id"] = key_id
        log.info("request", extra=extra)


class _BodyTooLarge(Exception):
    pass


class BodyLimitMiddleware:
    """413 for bodies over the limit: by Content-Length up front, else while reading (chunked)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, path_limits: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = path_limits or {}  # e.g. file uploads: their own, larger limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            await self._reject(send, max_bytes)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._reject(send, max_bytes)

    async def _reject(self, send: Send, max_bytes: int) -> None:
        message = f"Request body larger than {max_bytes} bytes"
        body = error_body(message, "invalid_request_error", code="request_too_large")
        await send_json(send, 413, body)

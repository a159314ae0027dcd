"""OpenAI-shaped errors: one exception type, one body builder, and the app's handlers."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError as RedisOutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shared.contracts import ErrorEvent

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """An error that becomes `{"error": {...}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        error_type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_type = error_type or _TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    @classmethod
    def from_event(cls, event: ErrorEvent) -> APIError:
        return cls(
            event.status,
            event.message,
            error_type=event.error_type,
            param=event.param,
            code=event.code,
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def redis_unavailable() -> APIError:
    return APIError(503, "Redis unavailable, try again later", code="redis_unavailable")


# Parts of a pydantic error location that name a union member, not a field:
# `prompt.str`, `prompt.list[int]`, `stream_options.StreamOptions`, `function-after[...]`.
_UNION_TAG = re.compile(r"^(str|int|float|bool|bytes|none|list|dict|tuple|set)$|[\[\-]|^[A-Z]")


def model_not_found(name: str) -> APIError:
    return APIError(
        404,
        f"The model `{name}` does not exist.",
        param="model",
        error_type="invalid_request_error",
        code="model_not_found",
    )


def error_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """`messages.0.role` from pydantic's loc, cut at the first union tag."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, str) and _UNION_TAG.search(part):
            break
        parts.append(str(part))
    return ".".join(parts) or None


_FASTAPI_PREFIXES = (("body",), ("header",), ("query",))


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """Turn pydantic's first error into a 400 naming the offending parameter."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "Invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError(400, "Request body is not valid JSON", code="invalid_json")
    loc = tuple(first.get("loc", ()))
    if isinstance(exc, RequestValidationError) and loc[:1] in _FASTAPI_PREFIXES:
        loc = loc[1:]  # FastAPI's own prefix (our bodies are parsed by `parse_body`)
    param = error_param(loc)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    code = "unsupported_parameter" if first.get("type") == "unsupported_parameter" else None
    return APIError(400, message, param=param, code=code or "invalid_parameter")


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, (ValidationError, RequestValidationError))
    return validation_error(exc).response()


async def _http(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
    return APIError(exc.status_code, message, headers=exc.headers).response()


async def _redis_down(_: Request, exc: Exception) -> JSONResponse:
    log.warning("redis unavailable", extra={"error": repr(exc)})
    return redis_unavailable().response()


def redis_full() -> APIError:
    return APIError(
        503,
        "Redis is full (maxmemory reached) and refuses writes; nothing was queued, retry later",
        code="redis_out_of_memory",
        headers={"Retry-After": "5"},
    )


async def _redis_full(_: Request, exc: Exception) -> JSONResponse:
    log.error("redis refuses writes: maxmemory reached", extra={"error": repr(exc)})
    return redis_full().response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(ValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(RedisConnectionError, _redis_down)
    app.add_exception_handler(RedisTimeoutError, _redis_down)
    app.add_exception_handler(RedisOutOfMemoryError, _redis_full)

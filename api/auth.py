"""Bearer API keys: constant-time comparison, and a short hash id that is safe to log."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from api.errors import APIError


def api_key_id(key: str) -> str:
    """A short, stable, non-reversible id for a key (logs, job ownership, per-key limits)."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _matches(candidate: str, keys: list[str]) -> bool:
    found = False
    for key in keys:  # no early exit: the time taken does not depend on which key matched
        found |= hmac.compare_digest(candidate.encode(), key.encode())
    return found


async def require_api_key(request: Request) -> str | None:
    """FastAPI dependency: the caller's key id, or None when no keys are configured."""
    keys: list[str] = request.app.state.services.settings.api_keys
    if not keys:
        return None
    token = _bearer(request)
    if token is None or not _matches(token, keys):
        raise APIError(
            401,
            "Missing or invalid API key; send 'Authorization: Bearer <key>'",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )
    key_id = api_key_id(token)
    request.state.api_key_id = key_id
    return key_id

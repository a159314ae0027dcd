"""Bearer API keys (held by `api/keys/keyring.py`): who is calling, and their quota."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.errors import APIError
from api.keys.keyring import api_key_id
from api.keys.limits import Quota

__all__ = ["api_key_id", "require_api_key"]


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


async def require_api_key(request: Request) -> str | None:
    """FastAPI dependency: the caller's key id, or None when no keys are configured.

    Also leaves the caller's `Quota` on `request.state.quota`, with the `x-ratelimit-*`
    headers the response will carry (the middleware adds them)."""
    if getattr(request.state, "quota", None) is not None:  # a route may depend on it twice
        return request.state.quota.policy.key_id
    services = request.app.state.services
    ring = services.keyring.current()
    if ring.is_open:
        policy = ring.anonymous
    else:
        token = _bearer(request)
        found = ring.find(token) if token is not None else None
        if found is None:
            raise APIError(
                401,
                "Missing or invalid API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        policy = found
        request.state.api_key_id = policy.key_id
    request.state.quota = Quota(policy)
    await services.limiter.peek(request.state.quota)
    return policy.key_id


# A route's `api_key_id: ApiKeyId` parameter: the caller's key id, checked (one declaration).
ApiKeyId = Annotated[str | None, Depends(require_api_key)]

"""Per-key requests and tokens per minute, answered the way OpenAI does: 429
`rate_limit_exceeded` with `Retry-After`, and `x-ratelimit-*` headers on every response of a
limited key (the Redis side is `shared/ratelimit.py`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError

from api.errors import APIError
from api.keys.keyring import KeyPolicy
from shared.contracts import JobPayload, TokenReservation
from shared.keys import Keys
from shared.ratelimit import ADMIT_LUA, WINDOW_S, format_reset, retry_after_s, settle_lua

log = logging.getLogger(__name__)

_REFUND_LUA = settle_lua(1, 1)
RATE_LIMIT_HEADERS = [
    f"x-ratelimit-{what}-{kind}"
    for kind in ("requests", "tokens")
    for what in ("limit", "remaining", "reset")
]


@dataclass
class Quota:
    """One request's caller and the `x-ratelimit-*` headers its response carries."""

    policy: KeyPolicy
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Admission:
    admitted: bool
    headers: dict[str, str]
    retry_ms: int
    second: int


def reservation_cost(payload: JobPayload) -> int:
    """What a job reserves: its prompt and every token it may generate (OpenAI's rule)."""
    prompt = sum(len(ids) for ids in payload.prompts)  # a completions list: every prompt
    return prompt + payload.num_choices * (payload.sampling.max_tokens or 0)


class RateLimiter:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._admit = redis.register_script(ADMIT_LUA)
        self._refund = redis.register_script(_REFUND_LUA)

    async def peek(self, quota: Quota) -> None:
        """Fill in the headers from the current counters (a Redis error leaves them out)."""
        if not quota.policy.is_limited:
            return
        try:
            quota.headers = (await self._run(quota.policy, 0, 0)).headers
        except (RedisError, OSError) as exc:
            log.debug("rate-limit headers unavailable: %r", exc)

    async def reserve(self, quota: Quota, payload: JobPayload) -> TokenReservation | None:
        """Count the request and reserve its tokens, or raise 429 `rate_limit_exceeded`."""
        policy = quota.policy
        if not policy.is_limited:
            return None
        cost = reservation_cost(payload)
        answer = await self._run(policy, 1, cost)
        quota.headers = answer.headers
        if answer.admitted:
            return TokenReservation(bucket=policy.bucket, tokens=cost, second=answer.second)
        raise _refusal(policy, cost, answer)

    async def refund(self, reservation: TokenReservation | None) -> None:
        """Give a whole reservation back (the job was refused after all)."""
        if reservation is not None:
            await self._refund(
                keys=[self.keys.rate_tokens(reservation.bucket)],
                args=[reservation.second, reservation.tokens],
            )

    async def _run(self, policy: KeyPolicy, requests: int, tokens: int) -> _Admission:
        reply = await self._admit(
            keys=[
                self.keys.rate_requests(policy.bucket),
                self.keys.rate_tokens(policy.bucket),
            ],
            args=[
                policy.requests_per_minute,
                policy.tokens_per_minute,
                requests,
                tokens,
                WINDOW_S,
            ],
        )
        admitted, req_limit, req_left, req_reset, tok_limit, tok_left, tok_reset, retry, now = (
            int(value) for value in reply
        )
        headers = _headers("requests", req_limit, req_left, req_reset)
        headers.update(_headers("tokens", tok_limit, tok_left, tok_reset))
        return _Admission(bool(admitted), headers, retry, now)


def _headers(kind: str, limit: int, remaining: int, reset_ms: int) -> dict[str, str]:
    """OpenAI's three headers for one limit; none for a dimension without a limit."""
    if limit <= 0:
        return {}
    return {
        f"x-ratelimit-limit-{kind}": str(limit),
        f"x-ratelimit-remaining-{kind}": str(remaining),
        f"x-ratelimit-reset-{kind}": format_reset(reset_ms),
    }


def _refusal(policy: KeyPolicy, cost: int, answer: _Admission) -> APIError:
    headers = dict(answer.headers)
    if answer.retry_ms < 0:  # larger than the whole limit: retrying cannot help
        message = (
            f"Request too large for key {policy.name}: it needs {cost} tokens "
            f"(prompt + max_tokens), the limit is {policy.tokens_per_minute} tokens per minute"
        )
    else:
        headers["Retry-After"] = str(retry_after_s(answer.retry_ms))
        message = (
            f"Rate limit reached for key {policy.name}: {policy.requests_per_minute or 'no'} "
            f"requests and {policy.tokens_per_minute or 'no'} tokens per minute allowed; "
            f"this request needs {cost} tokens. Retry in {format_reset(answer.retry_ms)}."
        )
    return APIError(429, message, code="rate_limit_exceeded", headers=headers)

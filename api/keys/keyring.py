"""API keys and what each may do, from one place: `LLM_API_KEYS` and the TOML file named by
`LLM_API_KEYS_FILE`, re-read when the file changes (no restart).

    # keys.toml: defaults for every key (0: no limit); a key's own values override them
    requests_per_minute = 600
    tokens_per_minute = 200000

    [keys.team-a]                # the name shown in logs
    key = "sk-team-a-secret"     # or key_sha256 = "<64 hex>": the file then holds no secret
    requests_per_minute = 60
    tokens_per_minute = 40000
    priority_min = -10           # the `priority` range its requests are clamped to
    priority_max = 100           # (default LLM_PRIORITY_MIN..LLM_PRIORITY_MAX; lower first)

Keys from `LLM_API_KEYS` get the file's defaults (else `LLM_RATE_LIMIT_*`). A per-key setting
is one more optional field on `KeyLimits`, resolved in `KeyPolicy` like the two limits.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import time
import tomllib
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.config import Settings

log = logging.getLogger(__name__)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# Bucket of the shared limits when no keys are configured (authentication off).
ANONYMOUS = "anonymous"


def key_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_id(key: str) -> str:
    """A short, stable, non-reversible id for a key (logs, job ownership, per-key limits)."""
    return key_sha256(key)[:16]


class KeyLimits(BaseModel):
    """Limits of a key, or the file's defaults; None: inherit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_minute: int | None = Field(None, ge=0)
    tokens_per_minute: int | None = Field(None, ge=0)
    priority_min: int | None = None
    priority_max: int | None = None

    @model_validator(mode="after")
    def _priority_range(self) -> KeyLimits:
        low, high = self.priority_min, self.priority_max
        if low is not None and high is not None and low > high:
            raise ValueError("priority_min must not be above priority_max")
        return self


class KeyEntry(KeyLimits):
    key: str | None = Field(None, min_length=1)
    key_sha256: str | None = None

    @model_validator(mode="after")
    def _one_secret(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give exactly one of `key` and `key_sha256`")
        if self.key_sha256 is not None and not _SHA256.match(self.key_sha256):
            raise ValueError("`key_sha256` must be 64 lowercase hex digits")
        return self

    @property
    def sha256(self) -> str:
        return self.key_sha256 or key_sha256(self.key or "")


class KeysFile(KeyLimits):
    keys: dict[str, KeyEntry] = Field(default_factory=dict)


@dataclass(frozen=True)
class KeyPolicy:
    """What one caller may do; `bucket` names its rate-limit counters in Redis."""

    name: str
    key_id: str | None
    requests_per_minute: int
    tokens_per_minute: int
    priority_min: int = 0
    priority_max: int = 0

    @property
    def priority_range(self) -> tuple[int, int]:
        """Where the key's `priority` values are clamped (a crossed pair: the max wins)."""
        return self.priority_min, max(self.priority_min, self.priority_max)

    @property
    def bucket(self) -> str:
        return self.key_id or ANONYMOUS

    @property
    def is_limited(self) -> bool:
        return bool(self.requests_per_minute or self.tokens_per_minute)

    @classmethod
    def resolve(cls, name: str, key_id: str | None, own: KeyLimits, base: KeyLimits) -> KeyPolicy:
        def pick(field: str) -> int:
            value = getattr(own, field)
            return value if value is not None else (getattr(base, field) or 0)

        return cls(name, key_id, *(pick(field) for field in KeyLimits.model_fields))


class KeyRing:
    """Full SHA-256 of each key -> its policy; `open` when no key is configured."""

    def __init__(self, policies: dict[str, KeyPolicy], anonymous: KeyPolicy) -> None:
        self.policies = policies
        self.anonymous = anonymous

    @property
    def is_open(self) -> bool:
        return not self.policies

    def find(self, token: str) -> KeyPolicy | None:
        """The token's policy; compares against every key (time independent of the match)."""
        digest = key_sha256(token).encode()
        found = None
        for sha, policy in self.policies.items():
            if hmac.compare_digest(digest, sha.encode()):
                found = policy
        return found


def parse_keys_file(text: str) -> KeysFile:
    """ValueError with the reason for a file that is not valid TOML or has bad entries."""
    try:
        return KeysFile.model_validate(tomllib.loads(text))
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"not valid TOML: {exc}") from exc
    except ValidationError as exc:  # without the input values: they may be secrets
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        ]
        raise ValueError("; ".join(problems)) from None


def build_keyring(settings: Settings, file: KeysFile | None) -> KeyRing:
    env_defaults = KeyLimits(
        requests_per_minute=settings.rate_limit_requests_per_minute,
        tokens_per_minute=settings.rate_limit_tokens_per_minute,
        priority_min=settings.priority_min,
        priority_max=settings.priority_max,
    )
    base = KeyPolicy.resolve("defaults", None, file or KeyLimits(), env_defaults)
    defaults = KeyLimits(**{field: getattr(base, field) for field in KeyLimits.model_fields})
    policies: dict[str, KeyPolicy] = {}
    for key in settings.api_keys:
        key_id = api_key_id(key)
        policies[key_sha256(key)] = KeyPolicy.resolve(key_id, key_id, KeyLimits(), defaults)
    for name, entry in (file.keys if file else {}).items():
        policies[entry.sha256] = KeyPolicy.resolve(name, entry.sha256[:16], entry, defaults)
    return KeyRing(policies, KeyPolicy.resolve(ANONYMOUS, None, KeyLimits(), defaults))


class KeyRingHolder:
    """The current key ring; looks at the file's mtime at most once per `check_s`. A file
    that fails to parse is logged and the previous ring stays in force."""

    def __init__(self, settings: Settings, check_s: float = 1.0) -> None:
        self.settings = settings
        self.path = settings.api_keys_file
        self.check_s = check_s
        self._mtime: int | None = None
        self._next_check = 0.0
        self.ring = build_keyring(settings, self._read() if self.path else None)

    def current(self) -> KeyRing:
        now = time.monotonic()
        if self.path and now >= self._next_check:
            self._next_check = now + self.check_s
            self._reload_if_changed()
        return self.ring

    def _reload_if_changed(self) -> None:
        try:
            mtime = os.stat(self.path or "").st_mtime_ns
        except OSError as exc:
            log.error("API keys file unreadable; keeping the loaded keys: %s", exc)
            return
        if mtime == self._mtime:
            return
        try:
            self.ring = build_keyring(self.settings, self._read())
            log.info("API keys reloaded", extra={"num_keys": len(self.ring.policies)})
        except (OSError, ValueError) as exc:
            log.error("API keys file invalid; keeping the loaded keys: %s", exc)

    def _read(self) -> KeysFile:
        assert self.path is not None
        self._mtime = os.stat(self.path).st_mtime_ns
        with open(self.path, encoding="utf-8") as handle:
            return parse_keys_file(handle.read())

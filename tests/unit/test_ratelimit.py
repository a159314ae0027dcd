"""Per-key requests/tokens per minute: the keys file, OpenAI's headers and 429, reservations
given back by the final write (the API's cancel of a queued job here; the worker's in
tests/integration/test_rate_limits.py)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from api.keys.keyring import KeyRingHolder, api_key_id, key_sha256, parse_keys_file
from shared.ratelimit import format_reset, retry_after_s
from tests.unit.api_harness import harness, make_settings

KEY_A, KEY_B = "sk-ladle-alpha-0123456789", "sk-ladle-bravo-9876543210"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
# The fake tokenizer: one token per byte plus BOS, so "Hello" is 6 prompt tokens.
BODY = {"model": "test-model", "prompt": "Hello", "max_tokens": 10}
JOB = {"url": "/v1/completions", "body": BODY}
COST = 6 + 10
HEADERS = [f"x-ratelimit-{w}-{k}" for k in ("requests", "tokens") for w in ("limit", "remaining")]


def _keys_file(path: Path, rpm: int, tpm: int) -> Path:
    path.write_text(
        f"requests_per_minute = {rpm}\ntokens_per_minute = {tpm}\n"
        f'[keys.alpha]\nkey = "{KEY_A}"\n'
        f'[keys.bravo]\nkey_sha256 = "{key_sha256(KEY_B)}"\nrequests_per_minute = 100\n'
    )
    return path


def _limits(response) -> dict[str, str]:  # noqa: ANN001
    return {name: response.headers.get(name) for name in HEADERS}


def test_reset_format_and_retry_after() -> None:
    assert [format_reset(ms) for ms in (0, 20, 999, 1000, 1500, 59_999, 60_000, 360_000)] == [
        "0s",
        "20ms",
        "999ms",
        "1s",
        "1.5s",
        "59.999s",
        "1m0s",
        "6m0s",
    ]
    assert [retry_after_s(ms) for ms in (1, 1000, 1001)] == [1, 1, 2]


def test_keys_file_defaults_overrides_and_env_keys(tmp_path: Path) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=3, tpm=1000)
    ring = KeyRingHolder(make_settings(api_keys_file=str(path), api_keys=["sk-env"])).current()
    alpha, bravo, env = ring.find(KEY_A), ring.find(KEY_B), ring.find("sk-env")
    assert alpha is not None and bravo is not None and env is not None
    assert (alpha.name, alpha.key_id, alpha.requests_per_minute, alpha.tokens_per_minute) == (
        "alpha",
        api_key_id(KEY_A),
        3,
        1000,
    )
    assert (bravo.name, bravo.requests_per_minute, bravo.tokens_per_minute) == ("bravo", 100, 1000)
    assert (env.requests_per_minute, env.tokens_per_minute) == (3, 1000)  # the file's defaults
    assert ring.find("sk-unknown") is None and not ring.is_open


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("requests_per_minute = -1", "requests_per_minute"),
        ("[keys.x]\nrequests_per_minute = 5", "exactly one of `key` and `key_sha256`"),
        ('[keys.x]\nkey_sha256 = "abc"', "64 lowercase hex"),
        ('[keys.x]\nkey = "sk-secret-value"\nrpm = 5', "keys.x.rpm"),
        ("requests_per_minute = ", "not valid TOML"),
    ],
)
def test_bad_keys_files_say_why_without_the_secret(text: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem) as exc:
        parse_keys_file(text)
    assert "sk-secret-value" not in str(exc.value)


def test_the_file_is_reloaded_and_a_bad_edit_keeps_the_old_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=3, tpm=1000)
    holder = KeyRingHolder(make_settings(api_keys_file=str(path)), check_s=0)
    _keys_file(path, rpm=7, tpm=2000)
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))
    policy = holder.current().find(KEY_A)
    assert policy is not None and policy.requests_per_minute == 7
    path.write_text('[keys.alpha]\nkey = "sk-new-secret"\nbogus = 1\n')
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 2_000_000))
    caplog.set_level(logging.ERROR)
    assert holder.current().find(KEY_A) is policy  # still the last good file
    assert "keeping the loaded keys" in caplog.text and "sk-new-secret" not in caplog.text


@pytest.mark.redis
async def test_requests_per_minute_headers_and_429(tmp_path: Path) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=2, tpm=1000)
    async with harness(api_keys_file=str(path)) as h:
        seen = []
        for _ in range(2):
            r = await h.client.post("/v1/completions", json=JOB["body"], headers=A)
            assert r.status_code == 200, r.text
            seen.append(_limits(r))
        assert [s["x-ratelimit-remaining-requests"] for s in seen] == ["1", "0"]
        assert seen[0]["x-ratelimit-limit-requests"] == "2"
        assert seen[0]["x-ratelimit-limit-tokens"] == "1000"
        refused = await h.client.post("/v1/completions", json=JOB["body"], headers=A)
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        assert len(refused.headers.get_list("retry-after")) == 1
        other = await h.client.post("/v1/completions", json=JOB["body"], headers=B)
        assert other.status_code == 200 and other.headers["x-ratelimit-remaining-requests"] == "99"
        models = await h.client.get("/v1/models", headers=A)  # every response of the key
        assert models.headers["x-ratelimit-remaining-requests"] == "0"
        bad = await h.client.post("/v1/completions", json={"prompt": 1}, headers=A)
        assert bad.status_code == 400 and "x-ratelimit-limit-requests" in bad.headers
        unauthenticated = await h.client.get("/v1/models")
        assert unauthenticated.status_code == 401
        assert "x-ratelimit-limit-requests" not in unauthenticated.headers
        assert await h.redis.zcard(h.keys.queue("test-model")) == 0  # nothing refused was queued


@pytest.mark.redis
async def test_tokens_are_reserved_and_a_cancelled_queued_job_gives_them_back(
    tmp_path: Path,
) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=100, tpm=2 * COST + 5)
    async with harness(start_worker=False, api_keys_file=str(path)) as h:
        first = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert first.status_code == 202
        assert first.headers["x-ratelimit-remaining-tokens"] == str(COST + 5)
        second = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert second.headers["x-ratelimit-remaining-tokens"] == "5"
        refused = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert refused.status_code == 429 and "retry-after" in refused.headers
        cancelled = await h.client.delete(f"/v1/jobs/{first.json()['id']}", headers=A)
        assert cancelled.json()["status"] == "cancelled"
        after = await h.client.get("/v1/models", headers=A)
        assert after.headers["x-ratelimit-remaining-tokens"] == str(COST + 5)
        assert (await h.client.post("/v1/jobs", json=JOB, headers=A)).status_code == 202


@pytest.mark.redis
async def test_a_request_larger_than_the_limit_is_refused_without_retry_after(
    tmp_path: Path,
) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=100, tpm=COST - 1)
    async with harness(start_worker=False, api_keys_file=str(path)) as h:
        r = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert r.status_code == 429 and "retry-after" not in r.headers
        assert "Request too large" in r.json()["error"]["message"]
        assert r.headers["x-ratelimit-remaining-requests"] == "100"  # nothing was counted


@pytest.mark.redis
async def test_a_later_refusal_gives_the_reservation_back(tmp_path: Path) -> None:
    path = _keys_file(tmp_path / "keys.toml", rpm=100, tpm=10 * COST)
    async with harness(start_worker=False, api_keys_file=str(path), max_queue_depth=1) as h:
        assert (await h.client.post("/v1/jobs", json=JOB, headers=A)).status_code == 202
        full = await h.client.post("/v1/jobs", json=JOB, headers=A)
        assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
        peek = await h.client.get("/v1/models", headers=A)
        assert peek.headers["x-ratelimit-remaining-tokens"] == str(9 * COST)


def test_a_crossed_priority_range_is_refused() -> None:
    with pytest.raises(ValueError, match="priority_min must not be above priority_max"):
        parse_keys_file('[keys.x]\nkey = "sk-secret-value"\npriority_min = 5\npriority_max = 1')

"""Per-key limits shared by two API processes on one Redis: the counters are one, the
`x-ratelimit-*` headers agree, an edited keys file applies without a restart, and the real
worker's final write gives back the tokens a job reserved but did not use."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.faults import PROMPT, model_id
from tests.support.harness import Service, start_service

ADMIN, ALPHA, BRAVO = "sk-admin-0000", "sk-alpha-1111", "sk-bravo-2222"


def _write_keys(path: Path, alpha_rpm: int) -> None:
    path.write_text(
        f'[keys.alpha]\nkey = "{ALPHA}"\nrequests_per_minute = {alpha_rpm}\n'
        f"tokens_per_minute = 100000\n"
        f'[keys.bravo]\nkey = "{BRAVO}"\nrequests_per_minute = 100\ntokens_per_minute = 1000\n'
    )
    stamp = time.time_ns() + alpha_rpm * 1_000_000  # a new mtime even within one clock tick
    os.utime(path, ns=(stamp, stamp))


@pytest.fixture(scope="module")
def two_apis(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, list[str], Path]]:
    keys_file = tmp_path_factory.mktemp("keys") / "keys.toml"
    _write_keys(keys_file, alpha_rpm=4)
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("logs"),
        api_keys=ADMIN,
        api_keys_file=keys_file,
    )
    urls = [svc.base_url, svc.start_extra_api()]
    svc.wait_ready(1)
    _wait_answering(urls[1])
    yield svc, urls, keys_file
    svc.stop()


def _wait_answering(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never ready")


def _complete(url: str, key: str, model: str, **extra: object) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **extra}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)


def test_two_api_processes_share_one_request_budget_and_reload_it(
    two_apis: tuple[Service, list[str], Path],
) -> None:
    svc, urls, keys_file = two_apis
    model = model_id(svc)
    answers = [_complete(urls[i % 2], ALPHA, model) for i in range(4)]
    assert [r.status_code for r in answers] == [200] * 4
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["3", "2", "1", "0"]
    assert {r.headers["x-ratelimit-limit-requests"] for r in answers} == {"4"}
    refused = _complete(urls[1], ALPHA, model)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert _complete(urls[0], ALPHA, model).status_code == 429  # the other process agrees
    _write_keys(keys_file, alpha_rpm=6)  # no restart: each process re-reads the file
    for url in urls:
        answer = _until_admitted(url, model)
        assert answer.headers["x-ratelimit-limit-requests"] == "6"
    assert _complete(urls[0], ALPHA, model).status_code == 429  # 6 used across both


def _until_admitted(url: str, model: str, timeout: float = 15) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = _complete(url, ALPHA, model)
        if answer.status_code == 200:
            return answer
        time.sleep(0.2)
    raise AssertionError(f"{url} never applied the edited keys file")


def test_the_worker_gives_back_unused_reserved_tokens(
    two_apis: tuple[Service, list[str], Path],
) -> None:
    svc, urls, _ = two_apis
    model = model_id(svc)
    full = _complete(urls[0], BRAVO, model, max_tokens=20, ignore_eos=True)
    assert full.status_code == 200, full.text
    used_full = full.json()["usage"]["total_tokens"]
    reserved = used_full  # prompt + 20: every reserved token was used
    assert full.headers["x-ratelimit-remaining-tokens"] == str(1000 - reserved)
    words = full.json()["choices"][0]["text"].split()
    short = _complete(urls[1], BRAVO, model, max_tokens=20, ignore_eos=True, stop=[words[2]])
    assert short.status_code == 200, short.text
    assert short.json()["usage"]["completion_tokens"] < 20
    # At admission the whole reservation was taken; the final write gave the rest back.
    assert short.headers["x-ratelimit-remaining-tokens"] == str(1000 - 2 * reserved)
    used = used_full + short.json()["usage"]["total_tokens"]
    peek = httpx.get(
        f"{urls[0]}/v1/models", headers={"Authorization": f"Bearer {BRAVO}"}, timeout=30
    )
    assert peek.headers["x-ratelimit-remaining-tokens"] == str(1000 - used)

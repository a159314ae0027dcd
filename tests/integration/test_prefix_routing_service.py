"""Cache-aware routing on two workers: a conversation's next turn lands on the worker that holds
its prefix (and hits its cache), and a job routed to a worker that never takes it still runs
elsewhere once its hold ends."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest import multiturn
from shared.contracts import PrefixFingerprint
from shared.keys import Keys
from shared.redis_url import sync_client
from tests.integration.test_service import _poll
from tests.support.harness import Service, start_service, wait_until

BLOCK = 16
HOLD_MS = 3000  # long: on a loaded machine a worker may take a while to poll


@pytest.fixture(scope="module")
def two_workers(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    svc = start_service(
        tiny_service_model,
        tmp_path_factory.mktemp("logs"),
        num_workers=2,
        ready_timeout_s=300.0,  # two workers starting at once on a busy machine
        prefix_routing_hold_ms=HOLD_MS,
    )
    yield svc
    svc.stop()


def _complete(http: httpx.Client, prompt: str) -> tuple[dict, dict]:
    """One greedy completion; the response and its job's record."""
    model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
    response = http.post("/v1/completions", json={**body, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return response.json(), http.get(f"/v1/jobs/{response.headers['X-Job-Id']}").json()


def _words(start: int, count: int) -> str:
    return " ".join(f"w{3 + (start + i) % 200}" for i in range(count))


def test_a_conversations_next_turns_land_where_its_prefix_is(two_workers: Service) -> None:
    with two_workers.client() as http:
        for conversation in range(4):
            prompt = _words(conversation * 50, 40)
            answer, job = _complete(http, prompt)
            home = job["worker_id"]
            for turn in range(2):
                prompt += answer["choices"][0]["text"] + " " + _words(turn * 7, 5)
                previous_tokens = answer["usage"]["prompt_tokens"]
                answer, job = _complete(http, prompt)
                where = f"conversation {conversation}, turn {turn + 2}"
                assert job["routed_to"] == job["worker_id"] == home, where
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                # At least every full block of the previous turn's prompt came from the cache.
                assert cached >= previous_tokens // BLOCK * BLOCK > 0


def test_a_job_routed_to_a_worker_that_never_takes_it_runs_elsewhere(
    two_workers: Service,
) -> None:
    """A 'ghost' that claims to hold every prefix, with room, but takes nothing (killed)."""
    redis = sync_client(two_workers.redis_url)
    keys = Keys(two_workers.prefix)
    real = json.loads(redis.get(keys.worker(two_workers.worker_id(0))))
    ghost = {**real, "worker_id": "ghost"}
    redis.set(keys.worker("ghost"), json.dumps(ghost), ex=60)
    redis.zadd(keys.workers, {"ghost": time.time() + 60})
    holds_everything = PrefixFingerprint(
        worker_id="ghost",
        model=real["model"],
        block_size=BLOCK,
        num_bits=1024,
        filter=base64.b64encode(b"\xff" * 128).decode(),
        room=8,
    )
    redis.set(keys.prefixes("ghost"), holds_everything.model_dump_json(), ex=60)
    try:
        with two_workers.client() as http:
            wait_until(  # the API's list of live workers, which the router reads, is cached
                lambda: "ghost" in {w["id"] for w in http.get("/v1/workers").json()["data"]},
                30,
                "the API to list the ghost worker",
            )
            started = time.monotonic()
            _, job = _complete(http, _words(120, 40))
            waited = time.monotonic() - started
    finally:
        redis.delete(keys.worker("ghost"), keys.prefixes("ghost"))
        redis.zrem(keys.workers, "ghost")
    assert job["status"] == "completed"
    assert job["routed_to"] == "ghost"
    assert job["worker_id"] in (two_workers.worker_id(0), two_workers.worker_id(1))
    assert waited >= HOLD_MS / 1000  # held for the ghost, then taken by a real worker


def test_routed_jobs_finish_like_any_other(two_workers: Service) -> None:
    with two_workers.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": _words(0, 40), "max_tokens": 4, "temperature": 0}
        job_ids = [
            http.post("/v1/jobs", json={"url": "/v1/completions", "body": body}).json()["id"]
            for _ in range(6)
        ]
        jobs = [_poll(http, job_id, timeout=60) for job_id in job_ids]
    assert [job["status"] for job in jobs] == ["completed"] * 6
    assert len({job["response"]["choices"][0]["text"] for job in jobs}) == 1


def test_the_multiturn_loadtest_measures_hits_and_routing(two_workers: Service) -> None:
    """A smoke run of `python -m loadtest.multiturn` on the tiny service."""
    argv = ["--conversations", "2", "--turns", "2", "--max-tokens", "4", "--question-words", "5"]
    args = multiturn.parse_args(argv)
    result = asyncio.run(multiturn.run_conversations(f"{two_workers.base_url}/v1", args, True))
    row = multiturn.summary(result)
    assert (row["requests"], row["errors"]) == (4, 0)
    assert row["possible_tokens_turns_2plus"] > 0
    assert row["routed"] == row["routed_taken_by_holder"] == 4
    assert "| on |" in multiturn.format_rows([row])

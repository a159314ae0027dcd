"""Token streams spread over three Redis instances (`LLM_RELAY_REDIS_URLS`): the OpenAI API,
the job API and cancellation work unchanged, each stream lands on the shard its job id hashes
to, and none stays on the main Redis, which keeps records and queues."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from shared.keys import Keys
from shared.relay_shards import shard_of
from tests.integration.faults import PROMPT, cancel_while_queued, expected_text
from tests.support.harness import TEST_REDIS_URL, Service, start_service
from tests.support.redis_topology import REDIS_SERVER, Node, redis_shards

pytestmark = pytest.mark.skipif(not REDIS_SERVER.startswith("/"), reason="needs redis-server")
NUM_SHARDS = 3


@pytest.fixture(scope="module")
def sharded(
    tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Service, list[Node]]]:
    with redis_shards(NUM_SHARDS, tmp_path_factory.mktemp("shards")) as shards:
        urls = ",".join(node.url for node in shards)
        svc = start_service(  # a worker stopped for a moment stays listed (the cancel test)
            tiny_service_model,
            tmp_path_factory.mktemp("logs"),
            relay_redis_urls=urls,
            worker_ttl_s=30,
        )
        try:
            yield svc, shards
        finally:
            svc.stop()


def _stream_text(response: httpx.Response) -> str:
    text = ""
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            text += "".join(c.get("text", "") for c in json.loads(line[6:])["choices"])
    return text


def test_requests_and_jobs_work_with_streams_on_shards(
    sharded: tuple[Service, list[Node]], tiny_service_model: Path
) -> None:
    svc, shards = sharded
    keys = Keys(svc.prefix)
    expected = expected_text(tiny_service_model, 8)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    job_ids = []
    with svc.client() as http:
        body["model"] = http.get("/v1/models").json()["data"][0]["id"]
        for _ in range(12):
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
            job_ids.append(answer.headers["X-Job-Id"])
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
            assert _stream_text(streamed) == expected
            job_ids.append(streamed.headers["X-Job-Id"])
        created = http.post("/v1/jobs", json={"url": "/v1/completions", "body": body}).json()
        with http.stream("GET", f"/v1/jobs/{created['id']}/events") as events:
            kinds = [
                json.loads(x[6:])["type"] for x in events.iter_lines() if x.startswith("data:")
            ]
        assert kinds[0] == "started" and kinds[-1] == "done"
        job_ids.append(created["id"])
    main = redis.Redis.from_url(TEST_REDIS_URL)
    assert not list(main.scan_iter(f"{svc.prefix}:stream:*"))  # records stay, streams moved
    assert all(main.exists(keys.job(job_id)) for job_id in job_ids)
    for job_id in job_ids:
        stream = keys.stream(job_id)
        holder = shards[shard_of(stream, NUM_SHARDS)].client()
        entries = holder.xrange(stream)
        assert json.loads(entries[-1][1][b"data"])["type"] == "done"  # the one terminal event
    # Spread, not all on one: 14 random job ids leave some shard empty 1 % of the time (3 x
    # (2/3)^14), and put all on one shard 6e-7 of the time.
    holding = [n for n, count in enumerate(_streams_per_shard(shards, svc.prefix)) if count]
    assert len(holding) > 1, f"every stream on shard {holding}"


def _streams_per_shard(shards: list[Node], prefix: str) -> list[int]:
    return [sum(1 for _ in node.client().scan_iter(f"{prefix}:stream:*")) for node in shards]


def test_cancelling_a_queued_job_reaches_its_stream_on_its_shard(
    sharded: tuple[Service, list[Node]],
) -> None:
    svc, shards = sharded
    keys = Keys(svc.prefix)
    job_id = cancel_while_queued(svc)
    stream = keys.stream(job_id)
    (entry,) = shards[shard_of(stream, NUM_SHARDS)].client().xrange(stream)
    assert json.loads(entry[1][b"data"])["code"] == "job_cancelled"

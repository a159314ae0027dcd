"""Token streams in a real 3-master Redis Cluster (`LLM_RELAY_REDIS_CLUSTER_URL`): streamed
completions and chat through the API relay arrive whole and in order, the streams spread over
every master (one slot group per XREAD), none stays on the main Redis, and a cancel made by
the API reaches its stream in the cluster. The cluster's processes are gone afterwards."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis

from shared.keys import Keys
from shared.relay_shards import CLUSTER_STREAM_GROUPS
from tests.integration.faults import PROMPT, cancel_while_queued, expected_text
from tests.support.harness import TEST_REDIS_URL, Service, start_service
from tests.support.redis_topology import REDIS_SERVER, RedisCluster, redis_cluster

pytestmark = pytest.mark.skipif(
    not REDIS_SERVER.startswith("/"), reason="needs redis-server and redis-cli on PATH"
)
NUM_STREAMED = 24  # a master gets no stream with chance 3 * (2/3)**24 < 0.02 %
MAX_TOKENS = 8


def _sse_texts(response: httpx.Response, field: str) -> list[str]:
    """Every chunk's text in arrival order (`text` of completions, `content` of chat)."""
    texts = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:])["choices"]:
                piece = choice.get("text") if field == "text" else choice["delta"].get(field)
                if piece:
                    texts.append(piece)
    return texts


def _stream_completion(svc: Service, body: dict) -> tuple[str, list[str]]:
    with svc.client() as http:
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return response.headers["X-Job-Id"], _sse_texts(response, "text")


def test_streams_in_a_cluster(tiny_service_model: Path, tmp_path: Path) -> None:
    expected = expected_text(tiny_service_model, MAX_TOKENS)
    with redis_cluster(3, tmp_path / "cluster") as cluster:
        svc = start_service(  # a worker stopped for a moment stays listed (the cancel below)
            tiny_service_model,
            tmp_path / "logs",
            relay_redis_cluster_url=cluster.url,
            worker_ttl_s=30,
        )
        try:
            job_ids = _streamed_jobs_arrive_whole(svc, expected)
            job_ids += _chat_streams_like_it_answers(svc)
            _streams_live_in_the_cluster(svc, cluster, job_ids)
            _cancel_reaches_the_cluster(svc, cluster)
        finally:
            svc.stop()
    assert all(node.proc is not None and node.proc.poll() is not None for node in cluster.masters)


def _streamed_jobs_arrive_whole(svc: Service, expected: str) -> list[str]:
    with svc.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    body["ignore_eos"] = True
    with ThreadPoolExecutor(max_workers=6) as pool:  # streams of many slot groups at once
        answers = list(pool.map(lambda _: _stream_completion(svc, body), range(NUM_STREAMED)))
    for _, pieces in answers:
        assert "".join(pieces) == expected  # every token, in order, once
        assert len(pieces) > 1  # it streamed, not one blob
    return [job_id for job_id, _ in answers]


def _chat_streams_like_it_answers(svc: Service) -> list[str]:
    with svc.client() as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        messages = [{"role": "user", "content": PROMPT}]
        body = {"model": model, "messages": messages, "max_tokens": MAX_TOKENS}
        body |= {"temperature": 0, "ignore_eos": True}
        answered = http.post("/v1/chat/completions", json=body)
        assert answered.status_code == 200
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as sse:
            assert sse.status_code == 200
            streamed = "".join(_sse_texts(sse, "content"))
            job_ids = [answered.headers["X-Job-Id"], sse.headers["X-Job-Id"]]
    assert streamed == answered.json()["choices"][0]["message"]["content"]
    return job_ids


def _streams_live_in_the_cluster(svc: Service, cluster: RedisCluster, job_ids: list[str]) -> None:
    keys = Keys(svc.prefix, stream_groups=CLUSTER_STREAM_GROUPS)
    main = redis.Redis.from_url(TEST_REDIS_URL)
    assert not list(main.scan_iter(f"{svc.prefix}:stream:*"))  # records stay, streams moved
    assert all(main.exists(keys.job(job_id)) for job_id in job_ids)
    client = cluster.client()
    for job_id in job_ids:
        stream = keys.stream(job_id)
        entries = client.xrange(stream)  # follows MOVED to the master that holds it
        assert json.loads(entries[-1][1][b"data"])["type"] == "done"  # the one terminal event
        assert 0 < client.ttl(stream) <= 24 * 3600  # abandoned streams expire
    per_master = cluster.keys_per_master(f"{svc.prefix}:stream:*")
    assert sum(per_master) == len(job_ids) and min(per_master) > 0, per_master
    client.close()


def _cancel_reaches_the_cluster(svc: Service, cluster: RedisCluster) -> None:
    job_id = cancel_while_queued(svc)
    stream = Keys(svc.prefix, stream_groups=CLUSTER_STREAM_GROUPS).stream(job_id)
    client = cluster.client()
    (entry,) = client.xrange(stream)
    assert json.loads(entry[1][b"data"])["code"] == "job_cancelled"
    client.close()

"""Limits, auth, operations endpoints, and the official openai client (bad input: see
test_api_bad_input.py)."""

from __future__ import annotations

import openai
import pytest

from tests.unit.api_harness import harness
from tests.unit.fake_worker import TOKENIZER

pytestmark = pytest.mark.redis
PROMPT = {"model": "test-model", "prompt": "Hello"}


async def test_unknown_model_and_no_workers() -> None:
    async with harness() as h:
        r = await h.client.post("/v1/completions", json={**PROMPT, "model": "gpt-9"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    async with harness(register=False) as h:
        r = await h.client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_workers"
        ready = await h.client.get("/ready")
        assert ready.status_code == 503 and "No live worker" in ready.json()["error"]["message"]


async def test_queue_full_429() -> None:
    async with harness(start_worker=False, max_queue_depth=1) as h:
        first = await h.client.post("/v1/jobs", json={"url": "/v1/completions", "body": PROMPT})
        assert first.status_code == 202
        r = await h.client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["code"] == "queue_full"


async def test_per_key_limit_429() -> None:
    async with harness(start_worker=False, api_keys=["k"], per_key_max_concurrent_jobs=1) as h:
        auth = {"Authorization": "Bearer k"}
        job = {"url": "/v1/completions", "body": PROMPT}
        assert (await h.client.post("/v1/jobs", json=job, headers=auth)).status_code == 202
        r = await h.client.post("/v1/jobs", json=job, headers=auth)
        assert r.status_code == 429 and "retry-after" in r.headers


async def test_auth() -> None:
    async with harness(api_keys=["secret"]) as h:
        r = await h.client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await h.client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert (await h.client.get("/health")).status_code == 200
        assert (await h.client.get("/ready")).status_code == 200
        r = await h.client.post(
            "/v1/completions", json=PROMPT, headers={"Authorization": "Bearer secret"}
        )
        assert r.status_code == 200
        assert h.worker.payloads[0].api_key_id not in (None, "secret")


async def test_redis_down_503() -> None:
    async with harness(redis_url="redis://127.0.0.1:1/0") as h:
        r = await h.client.post("/v1/completions", json=PROMPT)
        assert r.status_code == 503 and r.json()["error"]["code"] == "redis_unavailable"
        assert (await h.client.get("/ready")).status_code == 503
        assert (await h.client.get("/health")).status_code == 200


async def test_request_id_health_ready_models_workers_metrics() -> None:
    async with harness() as h:
        r = await h.client.get("/health", headers={"X-Request-Id": "abc-123"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
        generated = (await h.client.get("/nope")).headers["x-request-id"]
        assert generated.startswith("req-")
        assert (await h.client.get("/nope")).json()["error"]["type"] == "not_found_error"
        ready = await h.client.get("/ready")
        assert ready.status_code == 200 and ready.json()["max_model_len"] == 64
        models = (await h.client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["test-model"]
        described = {k: models["data"][0][k] for k in ("architecture", "weight_precision")}
        assert described == {"architecture": "LlamaForCausalLM", "weight_precision": "float32"}
        assert models["data"][0]["max_model_len"] == 64
        workers = (await h.client.get("/v1/workers")).json()["data"]
        assert workers[0]["kv_blocks_used"] == 3 and workers[0]["kv_cache_usage"] == 0.3
        await h.client.post("/v1/completions", json=PROMPT)
        text = (await h.client.get("/metrics")).text
        assert 'llm_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
        assert "llm_generation_tokens_total 5.0" in text and "llm_pending_requests" in text


async def test_tokenize_detokenize() -> None:
    async with harness() as h:
        r = await h.client.post("/tokenize", json={"model": "test-model", "prompt": "Hi"})
        assert r.json() == {"tokens": [1, 75, 108], "count": 3, "max_model_len": 64}
        r = await h.client.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]})
        expected = TOKENIZER.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert r.json()["tokens"] == expected
        r = await h.client.post("/detokenize", json={"tokens": [75, 108]})
        assert r.json() == {"prompt": "Hi"}
        r = await h.client.post("/tokenize", json={"model": "other", "prompt": "Hi"})
        assert r.status_code == 404


async def test_cors() -> None:
    async with harness(cors_origins=["http://ui.example"]) as h:
        r = await h.client.options(
            "/v1/completions",
            headers={"Origin": "http://ui.example", "Access-Control-Request-Method": "POST"},
        )
        assert r.headers["access-control-allow-origin"] == "http://ui.example"


async def test_official_openai_client() -> None:
    async with harness() as h:
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="unused", http_client=h.client
        )
        chat = await client.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "Hi"}], n=2, seed=1
        )
        assert [c.message.content for c in chat.choices] == ["Hi 0!", "Hi 1!"]
        stream = await client.completions.create(
            model="test-model", prompt="Hi", stream=True, stream_options={"include_usage": True}
        )
        pieces, usage = [], None
        async for chunk in stream:
            pieces += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
        assert "".join(pieces) == "Hi 0!" and usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError):
            await client.completions.create(model="test-model", prompt="Hi", temperature=3)

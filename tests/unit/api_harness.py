"""Test harness for the API: the app on httpx's ASGI transport, the real Redis (db 15) under
a unique key prefix, a scripted fake worker, and cleanup of every key the test wrote."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from arq.connections import ArqRedis
from arq.constants import job_key_prefix
from fastapi import FastAPI

from api.app import create_app, make_redis
from shared.config import Settings
from shared.keys import Keys
from tests.unit.fake_worker import TOKENIZER, FakeWorker, Script, default_script

REDIS_URL = os.environ.get("LLM_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def make_settings(**overrides: object) -> Settings:
    values: dict = {
        "redis_url": REDIS_URL,
        "key_prefix": f"test-api-{uuid.uuid4().hex[:10]}",
        "model_name": "test-model",
        "max_n": 4,
        "max_logit_bias": 5,
        "request_timeout_s": 10.0,
        "first_event_timeout_s": 5.0,
        "worker_ttl_s": 30.0,
        "api_keys": [],
        "cors_origins": [],
    }
    values.update(overrides)
    return Settings(**values)


@dataclass
class Harness:
    app: FastAPI
    client: httpx.AsyncClient
    redis: ArqRedis
    keys: Keys
    worker: FakeWorker
    settings: Settings


async def _cleanup(redis: ArqRedis, prefix: str) -> None:
    keys = [key async for key in redis.scan_iter(match=f"{prefix}:*", count=500)]
    job_ids = [Keys.job_id_of(k) for k in keys if k.decode().startswith(f"{prefix}:job:")]
    keys += [job_key_prefix + job_id for job_id in job_ids]
    if keys:
        await redis.delete(*keys)


@asynccontextmanager
async def harness(
    script: Script = default_script,
    *,
    start_worker: bool = True,
    register: bool = True,
    **overrides: object,
) -> AsyncIterator[Harness]:
    settings = make_settings(**overrides)
    keys = Keys(settings.key_prefix)
    redis = make_redis(make_settings(), keys)  # always the reachable test Redis
    try:
        await redis.ping()
    except OSError:
        await redis.aclose()
        pytest.skip(f"no Redis at {REDIS_URL}")
    app_redis = redis if settings.redis_url == REDIS_URL else None
    app = create_app(settings, redis=app_redis, tokenizer_loader=lambda _: TOKENIZER)
    worker = FakeWorker(redis, keys, script)
    if register:
        await worker.register()
    if start_worker:
        worker.start()
    transport = httpx.ASGITransport(app=app)
    client = httpx.AsyncClient(transport=transport, base_url="http://test")
    try:
        yield Harness(app, client, redis, keys, worker, settings)
    finally:
        await client.aclose()
        await worker.stop()
        services = app.state.services
        await services.relay.stop()
        await services.jobs.drain()
        await _cleanup(redis, settings.key_prefix)
        if app_redis is None:
            await services.redis.aclose()
        await redis.aclose()


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final [DONE]."""
    import json

    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out

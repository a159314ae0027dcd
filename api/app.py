"""The FastAPI application factory."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from arq.connections import ArqRedis
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.batches import file_routes as batch_file_routes
from api.batches import routes as batch_routes
from api.batches.control import BatchControl
from api.batches.files import FileStore
from api.batches.runner import BatchRunner
from api.batches.store import BatchStore
from api.embeddings import routes as embedding_routes
from api.errors import install_error_handlers
from api.jobs import routes as job_routes
from api.jobs.idempotency import IdempotencyStore
from api.jobs.reconcile import FailoverReconciler
from api.jobs.relay import Relay
from api.jobs.routing import PrefixRouter
from api.jobs.store import JobStore
from api.jobs.workers import WorkerDirectory
from api.keys.keyring import KeyRingHolder
from api.keys.limits import RATE_LIMIT_HEADERS, RateLimiter
from api.middleware import BodyLimitMiddleware, RequestContextMiddleware
from api.openai import routes as openai_routes
from api.openai.prompting import TokenizerHolder
from api.ops import console
from api.ops import routes as ops_routes
from api.services import Services
from shared import tracing
from shared.config import Settings, get_settings
from shared.contracts import QUEUED_GRACE_S
from shared.keys import Keys
from shared.metrics import ApiMetrics
from shared.queue import deserialize_job, serialize_job
from shared.redis_url import async_pool
from shared.redis_wire import pack_in_c
from shared.relay_shards import keys_for, stream_shards


def _pool_options() -> dict[str, Any]:
    return {
        "socket_connect_timeout": 2.0,
        "health_check_interval": 30,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


def make_redis(settings: Settings, keys: Keys) -> ArqRedis:
    """An arq-capable client that does not connect yet (arq's `create_pool` pings at once,
    which would stop the API from starting, and answering 503, while Redis is down). With a
    Sentinel URL each new connection goes to the primary the sentinels name now.

    A command on a pooled connection that Redis dropped (it restarted) reconnects and is
    sent again, twice at most, so the first requests after an outage do not fail."""
    pool = async_pool(settings.redis_url, **_pool_options())
    return ArqRedis(
        pool,
        job_serializer=serialize_job,
        job_deserializer=deserialize_job,
        default_queue_name=keys.batch_control_queue,
    )


def build_services(
    settings: Settings,
    redis: ArqRedis | None = None,
    tokenizer_loader: Callable[[Settings], Any] | None = None,
) -> Services:
    keys = keys_for(settings)
    redis = redis if redis is not None else make_redis(settings, keys)
    workers = WorkerDirectory(redis, keys, settings.worker_ttl_s)
    limiter = RateLimiter(redis, keys)
    shards = stream_shards(redis, settings, **_pool_options())
    return Services(
        settings=settings,
        keys=keys,
        redis=redis,
        relay=Relay(
            redis,
            keys,
            verify_delay_s=max(2.0, 5 * settings.heartbeat_interval_s),
            max_buffered=settings.stream_buffer_events,
            shards=shards,
        ),
        jobs=JobStore(
            redis,
            keys,
            settings,
            limiter,
            shards,
            router=PrefixRouter(
                redis,
                keys,
                workers,
                settings.prefix_routing,
                settings.prefix_routing_max_imbalance,
            ),
        ),
        workers=workers,
        tokenizer=TokenizerHolder(settings, tokenizer_loader, workers.source),
        metrics=ApiMetrics(),
        files=FileStore(redis, keys, settings.file_ttl_s),
        batches=BatchStore(redis, keys),
        keyring=KeyRingHolder(settings),
        limiter=limiter,
        idempotency=IdempotencyStore(redis, keys, QUEUED_GRACE_S + settings.job_ttl_s),
    )


ROUTERS = (
    openai_routes,
    embedding_routes,
    job_routes,
    batch_file_routes,
    batch_routes,
    ops_routes,
    console,
)


def create_app(
    settings: Settings | None = None,
    *,
    redis: ArqRedis | None = None,
    tokenizer_loader: Callable[[Settings], Any] | None = None,
) -> FastAPI:
    """Build the app. Nothing connects until the first request (or startup, under uvicorn).

    `redis` and `tokenizer_loader` are for tests; by default they come from `settings`.
    """
    settings = settings or get_settings()
    pack_in_c()
    services = build_services(settings, redis, tokenizer_loader)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tracing.configure(settings.otel_endpoint, "ladle-api")
        services.tokenizer.preload()
        services.relay.start()
        reconciler = FailoverReconciler(
            services.redis, services.keys, settings.job_ttl_s, services.jobs.shards
        )
        reconciler.start()
        control = None
        if settings.batch_control:
            runner = BatchRunner(services, services.batches, services.files)
            control = BatchControl(services, runner)
            control.start()
        yield
        if control is not None:
            await control.stop()
        await reconciler.stop()
        await services.relay.stop()
        await services.jobs.drain()
        await services.jobs.shards.aclose()
        await services.redis.aclose()
        tracing.shutdown()

    app = FastAPI(
        title="Ladle",
        version="0.1.0",
        lifespan=lifespan,
        description="OpenAI-compatible LLM inference over a Redis job queue.",
    )
    app.state.services = services
    install_error_handlers(app)
    for module in ROUTERS:
        app.include_router(module.router)
    upload_limit = settings.file_max_bytes + batch_file_routes.UPLOAD_OVERHEAD_BYTES
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_body_bytes,
        path_limits={"/v1/files": max(upload_limit, settings.max_request_body_bytes)},
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-Id", "X-Job-Id", *RATE_LIMIT_HEADERS],
        )
    app.add_middleware(RequestContextMiddleware, metrics=services.metrics)
    return app

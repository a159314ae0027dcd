"""Operations: liveness, readiness, Prometheus metrics, live workers."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from api.auth import require_api_key
from api.errors import APIError
from api.jobs.workers import supervised_children
from api.services import Services, ServicesDep
from shared.metrics import render

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/health")
async def health() -> dict:
    """Alive: the process answers. Says nothing about Redis or workers (see /ready)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(services: ServicesDep) -> JSONResponse:
    """Ready: Redis answers and a live worker serves the configured model. Under `ladle up`
    the body also lists the supervised processes, and `warnings` names any that crash-looped
    and are no longer restarted (the rest keep serving, so that alone is not a 503)."""
    try:
        await services.redis.ping()
        served = await services.workers.models()
        children = await supervised_children(services.redis, services.keys)
    except (RedisError, OSError) as exc:
        log.warning("not ready: redis", extra={"error": repr(exc)})
        return APIError(503, "Redis is unreachable", code="redis_unavailable").response()
    warnings = [c.message for c in children if c.state == "given_up" and c.message]
    model = services.settings.model_id
    if model not in served:
        message = " ".join([f"No live worker serves the model `{model}`.", *warnings])
        return APIError(503, message, code="no_workers").response()
    body = {"status": "ready", "model": model, "max_model_len": served[model]}
    if children:
        body["processes"] = [c.model_dump() for c in children]
        body["warnings"] = warnings
    return JSONResponse(body)


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(services: ServicesDep) -> Response:
    """Prometheus text format; needs a key when keys are set (Prometheus: `authorization`)."""
    try:
        await _observe_lanes(services)
    except (RedisError, OSError):
        pass  # the rest of the metrics are still worth scraping
    services.metrics.relay_buffered.set(services.relay.num_buffered)
    services.metrics.relay_paused.set(services.relay.num_paused)
    body, content_type = render(services.metrics.registry)
    return Response(body, media_type=content_type)


async def _observe_lanes(services: Services) -> None:
    """Queue depth of every known model's lanes; llm_pending_requests sums the interactive."""
    num_interactive = 0
    for model in await _known_models(services):
        for lane in ("interactive", "batch"):
            depth = await services.jobs.queue_depth(model, lane)
            services.metrics.lane_queue_depth.labels(model=model, lane=lane).set(depth)
            num_interactive += depth if lane == "interactive" else 0
    services.metrics.pending_requests.set(num_interactive)


@router.get("/v1/workers", dependencies=[Depends(require_api_key)])
async def workers(services: ServicesDep) -> dict:
    data = [
        {
            "id": w.worker_id,
            "object": "worker",
            "host": w.host,
            "pid": w.pid,
            "model": w.model,
            "task": w.task,
            "embedding_size": w.embedding_size,
            "device": w.device,
            "dtype": w.dtype,
            "architecture": w.architecture,
            "weight_precision": w.weight_precision,
            "deterministic": w.deterministic,
            "deterministic_reason": w.deterministic_reason,
            "compiled": w.compiled,
            "kernels": w.kernels,
            "status": w.status,
            "max_model_len": w.max_model_len,
            "block_size": w.block_size,
            "kv_blocks_used": w.kv_blocks_used,
            "kv_blocks_total": w.kv_blocks_total,
            "kv_cache_usage": w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0,
            "running": w.running,
            "waiting": w.waiting,
            "tokens_per_s": w.tokens_per_s,
            "started_at": w.started_at,
            "heartbeat_at": w.heartbeat_at,
        }
        for w in await services.workers.live()
    ]
    return {"object": "list", "data": data}


@router.get("/v1/queues", dependencies=[Depends(require_api_key)])
async def queues(services: ServicesDep) -> dict:
    """Jobs waiting in each queue (model and lane), for the console's fleet view."""
    return {
        "object": "list",
        "data": await services.jobs.queue_depths(await _known_models(services)),
    }


async def _known_models(services: Services) -> list[str]:
    """Models served now or lately, and the default one: the queues worth reporting."""
    return sorted(set(await services.workers.known()) | {services.settings.model_id})

"""Operations: liveness, readiness, Prometheus metrics, live workers."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from api.auth import require_api_key
from api.errors import APIError
from api.services import Services, get_services
from shared.metrics import render

log = logging.getLogger(__name__)
router = APIRouter()


@router.get("/health")
async def health() -> dict:
    """Alive: the process answers. Says nothing about Redis or workers (see /ready)."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(services: Services = Depends(get_services)) -> JSONResponse:
    """Ready: Redis answers and a live worker serves the configured model."""
    try:
        await services.redis.ping()
        served = await services.workers.models()
    except (RedisError, OSError) as exc:
        log.warning("not ready: redis", extra={"error": repr(exc)})
        return APIError(503, "Redis is unreachable", code="redis_unavailable").response()
    model = services.settings.model_id
    if model not in served:
        message = f"No live worker serves the model `{model}`"
        return APIError(503, message, code="no_workers").response()
    return JSONResponse({"status": "ready", "model": model, "max_model_len": served[model]})


@router.get("/metrics", dependencies=[Depends(require_api_key)])
async def metrics(services: Services = Depends(get_services)) -> Response:
    """Prometheus text format; needs a key when keys are set (Prometheus: `authorization`)."""
    try:
        services.metrics.pending_requests.set(await services.jobs.queue_depth())
    except (RedisError, OSError):
        pass  # the rest of the metrics are still worth scraping
    body, content_type = render(services.metrics.registry)
    return Response(body, media_type=content_type)


@router.get("/v1/workers", dependencies=[Depends(require_api_key)])
async def workers(services: Services = Depends(get_services)) -> dict:
    data = [
        {
            "id": w.worker_id,
            "object": "worker",
            "host": w.host,
            "pid": w.pid,
            "model": w.model,
            "device": w.device,
            "dtype": w.dtype,
            "status": w.status,
            "max_model_len": w.max_model_len,
            "block_size": w.block_size,
            "kv_blocks_used": w.kv_blocks_used,
            "kv_blocks_total": w.kv_blocks_total,
            "kv_cache_usage": w.kv_blocks_used / w.kv_blocks_total if w.kv_blocks_total else 0.0,
            "running": w.running,
            "waiting": w.waiting,
            "started_at": w.started_at,
            "heartbeat_at": w.heartbeat_at,
        }
        for w in await services.workers.live()
    ]
    return {"object": "list", "data": data}

"""`POST /v1/embeddings`, `POST /v1/rerank`, `POST /v1/score` (and vLLM's unversioned
`/rerank`, `/score` spellings): served by embedding and cross-encoder workers."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from api.auth import ApiKeyId
from api.embeddings.formatting import embedding_response, rerank_response, score_response
from api.embeddings.inputs import JobOptions
from api.embeddings.jobs import prepare_embedding, prepare_ranking, run_job
from api.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from api.openai.admission import allowed_priorities, parse_body
from api.openai.completions import observe_done
from api.openai.protocol import openapi_body
from api.services import Services, ServicesDep
from shared.contracts import DoneEvent, JobPayload, PoolingResult
from shared.logging import job_id_var

router = APIRouter()


def _options(request: Request, services: Services, api_key_id: str | None) -> JobOptions:
    settings = services.settings
    return JobOptions(
        api_key_id=api_key_id,
        priority_range=allowed_priorities(request)
        or (settings.priority_min, settings.priority_max),
        deadline_s=settings.request_timeout_s,
    )


async def _run(
    request: Request, services: Services, payload: JobPayload, url: str
) -> tuple[DoneEvent, PoolingResult]:
    job_id_var.set(payload.id)
    done = await run_job(request, services, payload, url)
    observe_done(services, done, payload.endpoint)
    return done, done.pooling or PoolingResult()


@router.post("/v1/embeddings", openapi_extra=openapi_body(EmbeddingRequest))
async def embeddings(request: Request, api_key_id: ApiKeyId, services: ServicesDep) -> JSONResponse:
    body = await parse_body(request, EmbeddingRequest)
    payload = await prepare_embedding(services, body, _options(request, services, api_key_id))
    done, result = await _run(request, services, payload, "/v1/embeddings")
    response = embedding_response(payload.model, result, done.usage, body.encoding_format)
    return JSONResponse(response, headers={"X-Job-Id": payload.id})


@router.post("/v1/rerank", openapi_extra=openapi_body(RerankRequest))
@router.post("/rerank", include_in_schema=False)
async def rerank(request: Request, api_key_id: ApiKeyId, services: ServicesDep) -> JSONResponse:
    body = await parse_body(request, RerankRequest)
    options = _options(request, services, api_key_id)
    payload = await prepare_ranking(services, "rerank", body, options)
    done, result = await _run(request, services, payload, "/v1/rerank")
    response = rerank_response(payload.id, payload.model, result, done.usage, body)
    return JSONResponse(response, headers={"X-Job-Id": payload.id})


@router.post("/v1/score", openapi_extra=openapi_body(ScoreRequest))
@router.post("/score", include_in_schema=False)
async def score(request: Request, api_key_id: ApiKeyId, services: ServicesDep) -> JSONResponse:
    body = await parse_body(request, ScoreRequest)
    payload = await prepare_ranking(
        services, "score", body, _options(request, services, api_key_id)
    )
    done, result = await _run(request, services, payload, "/v1/score")
    response = score_response(payload.id, payload.model, result, done.usage)
    return JSONResponse(response, headers={"X-Job-Id": payload.id})

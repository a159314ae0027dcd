"""The job API, shaped like one line of OpenAI's Batch API: submit, poll, events, cancel."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.responses import JSONResponse, StreamingResponse

from api.auth import ApiKeyId, require_api_key
from api.errors import APIError
from api.jobs.idempotency import fingerprint, idempotency_key
from api.jobs.relay import parse_entry_id
from api.jobs.store import NotConfirmed
from api.jobs.trace import RequestTrace
from api.keys.limits import Quota
from api.openai.admission import (
    allowed_priorities,
    parse_body,
    parse_dict,
    prepare_job,
    response_context,
)
from api.openai.formatting import build_response, usage_dict
from api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JobCreateRequest,
    openapi_body,
)
from api.services import Services, ServicesDep
from shared.contracts import (
    FINAL_STATUSES,
    TERMINAL_EVENT_TYPES,
    JobPayload,
    JobRecord,
    JobResult,
    encode_event,
)
from shared.logging import job_id_var

router = APIRouter(dependencies=[Depends(require_api_key)])
_IDLE_CHECK_S = 2.0
_ENTRY_ID = re.compile(r"^[0-9]{1,20}(-[0-9]{1,20})?$")


def job_summary(record: JobRecord) -> dict[str, Any]:
    """The record without the response: status, attempts, times, usage, phase timings."""
    obj: dict[str, Any] = {
        "id": record.id,
        "object": "job",
        "url": record.url,
        "model": record.model,
        "status": record.status,
        "created_at": record.created_at,
        "started_at": record.started_at,
        "finished_at": record.finished_at,
        "attempts": record.attempts,
        "worker_id": record.worker_id,
        "routed_to": record.routed_to,
        "request_id": record.request_id,
        "usage": None,
        "timings": None,
        "response": None,
        "error": None,
    }
    if record.result is not None:
        obj["usage"] = usage_dict(record.result.usage)
        obj["timings"] = record.result.timings.model_dump()
    if record.error is not None:
        obj["error"] = APIError.from_event(record.error).body()["error"]
        obj["error"]["status"] = record.error.status
    return obj


# endpoint -> its finished job's response, for endpoints answered without generated text
# (the embeddings room registers /v1/embeddings, /v1/rerank and /v1/score at import)
POOLED_RESPONSES: dict[str, Callable[[JobPayload, JobResult], dict[str, Any]]] = {}


async def job_object(services: Services, record: JobRecord) -> dict[str, Any]:
    """`GET /v1/jobs/{id}`: the record, with the OpenAI response or error when final."""
    obj = job_summary(record)
    if record.result is not None:
        payload = await services.jobs.payload(record.id)
        if payload is not None and payload.endpoint in POOLED_RESPONSES:
            obj["response"] = POOLED_RESPONSES[payload.endpoint](payload, record.result)
        elif payload is not None:
            ctx = await response_context(services, payload, include_usage=False)
            obj["response"] = build_response(ctx, record.result.choices, record.result.usage)
    return obj


@router.get("/v1/jobs")
async def list_jobs(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    limit: int = Query(20, ge=1, le=100),
) -> dict:
    """The caller's newest jobs (sync and streamed requests are jobs too), newest first."""
    records = await services.jobs.recent(api_key_id, limit)
    return {"object": "list", "data": [job_summary(r) for r in records]}


@router.post("/v1/jobs", status_code=202, openapi_extra=openapi_body(JobCreateRequest))
async def create_job(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    request: Request,
) -> JSONResponse:
    """Submit a job (202). With `Idempotency-Key`, the same key and body give back the first
    job (202, `Idempotent-Replayed: true`) and another body a 409."""
    key = idempotency_key(request)
    envelope = await parse_body(request, JobCreateRequest)
    model = CompletionRequest if envelope.url == "/v1/completions" else ChatCompletionRequest
    body = parse_dict({**envelope.body, "stream": False}, model)  # jobs are polled
    received = time.time()
    payload = await prepare_job(
        services,
        body,
        api_key_id=api_key_id,
        deadline_s=None,
        priority_range=allowed_priorities(request),
    )
    job_id_var.set(payload.id)
    if key is None:
        record = await _submit(services, payload, envelope.url, request.state.quota, received)
        return JSONResponse(await job_object(services, record), status_code=202)
    claim = await services.idempotency.claim(
        request.state.quota.policy.bucket,
        key,
        fingerprint(await request.body()),
        payload.id,
        exists=lambda job_id: _job_exists(services, job_id),
    )
    if claim.existing_id is not None:
        job_id_var.set(claim.existing_id)
        record = await services.jobs.get_owned(claim.existing_id, api_key_id)
        headers = {"Idempotent-Replayed": "true"}
        return JSONResponse(await job_object(services, record), 202, headers=headers)
    try:
        record = await _submit(services, payload, envelope.url, request.state.quota, received)
    except NotConfirmed:
        raise  # the job exists: a retry with the same key replays it
    except BaseException:
        await services.idempotency.release(claim)
        raise
    return JSONResponse(await job_object(services, record), status_code=202)


async def _submit(
    services: Services, payload: JobPayload, url: str, quota: Quota, received: float
) -> JobRecord:
    """Enqueue under the request's span (from `received`); the worker's spans continue it."""
    trace = RequestTrace("/v1/jobs", payload, start=received)
    try:
        with trace.enqueue():
            return await services.jobs.submit(payload, url, quota)
    finally:
        trace.finish()


async def _job_exists(services: Services, job_id: str) -> bool:
    return await services.jobs.get(job_id) is not None


@router.get("/v1/jobs/{job_id}")
async def get_job(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    job_id: str,
) -> dict:
    return await job_object(services, await services.jobs.get_owned(job_id, api_key_id))


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    job_id: str,
) -> dict:
    await services.jobs.get_owned(job_id, api_key_id)
    record = await services.jobs.cancel(job_id)
    if record is None:
        raise APIError(404, f"No job with id '{job_id}'", param="job_id", code="job_not_found")
    return await job_object(services, record)


@router.get("/v1/jobs/{job_id}/events")
async def job_events(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    job_id: str,
    last_event_id: str | None = Header(None),
) -> StreamingResponse:
    """Every event as SSE (`id:` = stream entry id), from the start or after Last-Event-ID."""
    start = _start_id(last_event_id)
    await services.jobs.get_owned(job_id, api_key_id)
    return StreamingResponse(_events(services, job_id, start), media_type="text/event-stream")


def _start_id(last_event_id: str | None) -> str:
    """The stream id to read after: `ms-seq` (or `ms`), both below 2**64, else a 400. Only
    well-formed ids may reach the relay, whose one XREAD serves every subscriber."""
    text = (last_event_id or "0-0").strip()
    try:
        if not _ENTRY_ID.match(text):
            raise ValueError(text)
        ms, seq = parse_entry_id(text)
        if ms >= 2**64 or seq >= 2**64:
            raise ValueError(text)
    except ValueError as exc:
        raise APIError(400, "Malformed Last-Event-ID header", param="Last-Event-ID") from exc
    return f"{ms}-{seq}"


async def _events(services: Services, job_id: str, start: str) -> AsyncIterator[str]:
    sub = services.relay.subscribe(job_id, start)
    try:
        while True:
            try:
                entry_id, event = await sub.next(_IDLE_CHECK_S)
            except TimeoutError:
                # Nothing new: the job may have ended before `start`, or expired.
                record = await services.jobs.get(job_id)
                if record is None or record.status in FINAL_STATUSES:
                    return
                yield ": keep-alive\n\n"
                continue
            yield f"id: {entry_id}\nevent: {event.type}\ndata: {encode_event(event)}\n\n"
            if event.type in TERMINAL_EVENT_TYPES:
                return
    finally:
        services.relay.unsubscribe(sub)

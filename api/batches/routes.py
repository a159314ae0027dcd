"""`/v1/batches`: create, retrieve, list, cancel; the work itself is queued (batch_runner)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from api.auth import ApiKeyId
from api.batches.contracts import COMPLETION_WINDOWS, BatchRecord, new_batch_id
from api.batches.file_routes import owner_of
from api.batches.files import list_object
from api.batches.runner import ControlQueue
from api.errors import APIError
from api.jobs.idempotency import fingerprint, idempotency_key
from api.openai.admission import allowed_priorities, parse_body
from api.openai.protocol import BatchCreateRequest, openapi_body
from api.services import Services, ServicesDep

router = APIRouter()


@router.post("/v1/batches", openapi_extra=openapi_body(BatchCreateRequest))
async def create_batch(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    request: Request,
) -> JSONResponse:
    """Create a batch. With `Idempotency-Key`, the same key and body give back the first
    batch (`Idempotent-Replayed: true`) and another body a 409."""
    key = idempotency_key(request)
    record = await _new_batch(request, services, owner_of(api_key_id))
    if key is None:
        return JSONResponse(await _start(services, record))
    claim = await services.idempotency.claim(
        request.state.quota.policy.bucket,
        key,
        fingerprint(await request.body()),
        record.id,
        exists=lambda batch_id: _batch_exists(services, batch_id),
    )
    if claim.existing_id is not None:
        existing = await services.batches.get_owned(claim.existing_id, record.owner)
        return JSONResponse(existing.public(), headers={"Idempotent-Replayed": "true"})
    try:
        return JSONResponse(await _start(services, record))
    except BaseException:
        await services.idempotency.release(claim)
        raise


async def _batch_exists(services: Services, batch_id: str) -> bool:
    return await services.batches.get(batch_id) is not None


async def _start(services: Services, record: BatchRecord) -> dict[str, Any]:
    await services.batches.create(record)
    await ControlQueue(services).expand(record.id, 0)
    return record.public()


async def _new_batch(request: Request, services: Services, owner: str) -> BatchRecord:
    """The batch a valid request describes (not stored yet); 400/404 for a bad one."""
    body = await parse_body(request, BatchCreateRequest)
    input_file = await services.files.get(body.input_file_id, owner)
    if input_file.purpose != "batch":
        raise APIError(400, 'The input file\'s purpose must be "batch"', param="input_file_id")
    now = int(time.time())
    return BatchRecord(
        id=new_batch_id(),
        endpoint=body.endpoint,
        input_file_id=body.input_file_id,
        completion_window=body.completion_window,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[body.completion_window],
        metadata=body.metadata,
        owner=owner,
        priority_range=allowed_priorities(request),
    )


@router.get("/v1/batches/{batch_id}")
async def get_batch(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    batch_id: str,
) -> dict[str, Any]:
    record = await services.batches.get_owned(batch_id, owner_of(api_key_id))
    await ControlQueue(services).ensure(record)
    return record.public()


@router.get("/v1/batches")
async def list_batches(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
) -> dict[str, Any]:
    records, has_more = await services.batches.list(owner_of(api_key_id), after, limit)
    return list_object([r.public() for r in records], has_more)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    batch_id: str,
) -> dict[str, Any]:
    """validating/in_progress -> cancelling: queued lines stop, finished ones are kept; the
    batch ends `cancelled` once the lines running now finish."""
    await services.batches.get_owned(batch_id, owner_of(api_key_id))

    def start_cancel(record: BatchRecord) -> bool:
        if record.status not in ("validating", "in_progress"):
            return False
        record.status, record.cancelling_at = "cancelling", int(time.time())
        return True

    record = await services.batches.update(batch_id, start_cancel)
    if record is None:
        raise APIError(404, f"No such Batch object: {batch_id}", code="batch_not_found")
    if record.status not in ("cancelling", "cancelled"):
        raise APIError(
            409,
            f"A batch with status {record.status} cannot be cancelled",
            param="batch_id",
            code="batch_not_cancellable",
        )
    await ControlQueue(services).collect(record.id, record.collect_seq, soon=True)
    return record.public()

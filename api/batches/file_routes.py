"""`/v1/files`, as the official openai client speaks it (purpose `batch`: JSONL, each line
checked; a bad line is a 400 naming it)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from starlette.datastructures import UploadFile

from api.auth import ApiKeyId
from api.batches.contracts import NO_OWNER, FileRecord, new_file_id
from api.batches.files import list_object, parse_batch_file
from api.errors import APIError
from api.services import ServicesDep

router = APIRouter()
UPLOAD_OVERHEAD_BYTES = 64 * 1024  # multipart framing and the other form fields


def owner_of(api_key_id: str | None) -> str:
    return api_key_id or NO_OWNER


async def _read_form(request: Request) -> tuple[str, UploadFile]:
    try:
        form = await request.form(max_files=1, max_fields=8)
    except Exception as exc:  # malformed multipart: the parser's own exception types vary
        raise APIError(400, f"Malformed multipart form: {exc}", param="file") from exc
    purpose, upload = form.get("purpose"), form.get("file")
    if not isinstance(upload, UploadFile):
        raise APIError(400, "A multipart `file` field is required", param="file")
    if purpose != "batch":
        raise APIError(400, 'purpose must be "batch"', param="purpose", code="invalid_purpose")
    return purpose, upload


@router.post("/v1/files")
async def create_file(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    request: Request,
) -> dict[str, Any]:
    settings = services.settings
    purpose, upload = await _read_form(request)
    content = await upload.read()
    if len(content) > settings.file_max_bytes:
        raise APIError(
            413, f"The file is larger than {settings.file_max_bytes} bytes", param="file"
        )
    lines = parse_batch_file(content, settings.batch_max_lines)
    record = FileRecord(
        id=new_file_id(),
        bytes=len(content),
        filename=upload.filename or "upload.jsonl",
        purpose=purpose,
        owner=owner_of(api_key_id),
        num_lines=len(lines),
    )
    await services.files.put(record, content)
    return record.public()


@router.get("/v1/files")
async def list_files(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    after: str | None = None,
    limit: int = Query(10_000, ge=1, le=10_000),
    purpose: str | None = None,
) -> dict[str, Any]:
    records, has_more = await services.files.list(owner_of(api_key_id), after, limit)
    items = [r.public() for r in records if purpose is None or r.purpose == purpose]
    return list_object(items, has_more)


@router.get("/v1/files/{file_id}")
async def get_file(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    file_id: str,
) -> dict[str, Any]:
    return (await services.files.get(file_id, owner_of(api_key_id))).public()


@router.get("/v1/files/{file_id}/content")
async def file_content(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    file_id: str,
) -> Response:
    content = await services.files.content(file_id, owner_of(api_key_id))
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(
    api_key_id: ApiKeyId,
    services: ServicesDep,
    file_id: str,
) -> dict[str, Any]:
    await services.files.delete(file_id, owner_of(api_key_id))
    return {"id": file_id, "object": "file", "deleted": True}

"""Wire contracts of the Batch API: files, batches, and the ids derived from them.

Both live in Redis and are read by every API process (see DESIGN.md, "The Batch API").
The objects serialise to exactly what OpenAI's `/v1/files` and `/v1/batches` return.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
FINAL_BATCH_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FilePurpose = Literal["batch", "batch_output", "user_data"]
COMPLETION_WINDOWS = {"24h": 86_400}
NO_OWNER = "-"  # the owner of files and batches when API keys are off


def new_file_id() -> str:
    return "file-" + secrets.token_urlsafe(18)


def new_batch_id() -> str:
    # No '-' or '_' after the prefix: line job ids append "-NNNNNN" and must stay parseable.
    return "batch_" + secrets.token_hex(16)


def line_job_id(batch_id: str, line: int) -> str:
    """The job id of a batch's line (0-based): derived, so enqueueing twice is a no-op."""
    return f"{batch_id}-{line:06d}"


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output (`ok`) or error (`err`) file: derived, so writing it again
    after a crash replaces nothing."""
    return f"file-{batch_id}-{'output' if kind == 'ok' else 'errors'}"


class FileRecord(BaseModel):
    """OpenAI's File object, plus the owner (never shown)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(default_factory=lambda: int(time.time()))
    expires_at: int | None = None
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    owner: str = Field(NO_OWNER, exclude=True)
    num_lines: int = Field(0, exclude=True)

    def public(self) -> dict[str, Any]:
        return self.model_dump()


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class BatchRecord(BaseModel):
    """OpenAI's Batch object, plus the bookkeeping of its execution (never shown)."""

    model_config = ConfigDict(extra="ignore")

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    # Bookkeeping: who owns it, how many lines are enqueued, the collector chain's position.
    owner: str = Field(NO_OWNER, exclude=True)
    num_expanded: int = Field(0, exclude=True)
    collect_seq: int = Field(0, exclude=True)
    lines_stopped: bool = Field(False, exclude=True)
    priority_range: tuple[int, int] | None = Field(None, exclude=True)  # the owner's key's

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_BATCH_STATUSES

    def public(self) -> dict[str, Any]:
        return self.model_dump()


def stored_json(record: BaseModel) -> str:
    """A record's JSON as kept in Redis: the public object and its hidden bookkeeping
    (the `exclude=True` fields, which `model_dump` leaves out of API answers)."""
    data = record.model_dump(mode="json")
    for name, info in type(record).model_fields.items():
        if info.exclude:
            data[name] = getattr(record, name)
    return json.dumps(data, separators=(",", ":"))

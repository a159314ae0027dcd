"""Typed, versioned messages that cross Redis: job payload, stream events, worker record.

Everything is JSON (pydantic), never pickle. Bump WIRE_VERSION on an incompatible change;
readers reject messages of another major version with a clear error.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

WIRE_VERSION = 1

Endpoint = Literal["completions", "chat.completions"]
JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
FINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)
    v: int = WIRE_VERSION


class SamplingSpec(BaseModel):
    """Sampling parameters as they cross the wire; the worker maps them onto SamplingParams."""

    model_config = ConfigDict(extra="forbid")

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


class JobPayload(_Wire):
    """One normalised completion request, as the API enqueues it."""

    id: str
    endpoint: Endpoint
    model: str
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    echo: bool = False
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    stream: bool = False
    priority: int = 0
    deadline: float | None = None
    request_id: str | None = None
    api_key_id: str | None = None
    created: float = Field(default_factory=time.time)


class TokenLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[TopLogprob] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token_id: int
    token: str
    logprob: float
    bytes: list[int] | None = None


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int = 0


class Timings(BaseModel):
    """Seconds since the epoch for each milestone, plus derived durations."""

    queued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None


class ChoiceEnd(BaseModel):
    index: int
    finish_reason: str


class StartedEvent(_Wire):
    type: Literal["started"] = "started"
    worker_id: str
    prompt_tokens: int
    attempt: int = 1


class DeltaEvent(_Wire):
    type: Literal["delta"] = "delta"
    index: int = 0
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None


class RestartEvent(_Wire):
    """A new attempt begins; the client drops what it got from earlier attempts."""

    type: Literal["restart"] = "restart"
    attempt: int
    reason: str


class DoneEvent(_Wire):
    type: Literal["done"] = "done"
    choices: list[ChoiceEnd]
    usage: Usage
    timings: Timings = Field(default_factory=Timings)


class ErrorEvent(_Wire):
    type: Literal["error"] = "error"
    status: int
    error_type: str
    message: str
    param: str | None = None
    code: str | None = None


StreamEvent = Annotated[
    StartedEvent | DeltaEvent | RestartEvent | DoneEvent | ErrorEvent, Field(discriminator="type")
]
_event_adapter: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)
TERMINAL_EVENT_TYPES: frozenset[str] = frozenset({"done", "error"})


def encode_event(event: BaseModel) -> str:
    return event.model_dump_json(exclude_none=True)


def decode_event(raw: str | bytes) -> StreamEvent:
    """Parse one stream entry's `data` field; raises ValueError on another wire version."""
    event = _event_adapter.validate_json(raw)
    if event.v != WIRE_VERSION:
        raise ValueError(f"stream event of wire version {event.v}, expected {WIRE_VERSION}")
    return event


class WorkerRecord(_Wire):
    """What a worker says about itself in every heartbeat."""

    worker_id: str
    host: str
    pid: int
    model: str
    device: str
    dtype: str
    status: Literal["starting", "ready", "draining"] = "ready"
    max_model_len: int
    block_size: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes_per_block: int = 0
    running: int = 0
    waiting: int = 0
    started_at: float = Field(default_factory=time.time)
    heartbeat_at: float = Field(default_factory=time.time)


class ChoiceResult(BaseModel):
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None = None


class JobResult(BaseModel):
    """The finished job's output; the API turns it into the OpenAI response object."""

    prompt_token_ids: list[int] | None = None
    choices: list[ChoiceResult]
    usage: Usage
    timings: Timings = Field(default_factory=Timings)


class JobRecord(_Wire):
    """The job's state as `GET /v1/jobs/{id}` reads it (stored as JSON under the job key)."""

    id: str
    status: JobStatus = "queued"
    url: str
    model: str
    api_key_id: str | None = None
    request_id: str | None = None
    attempts: int = 0
    worker_id: str | None = None
    created_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    result: JobResult | None = None
    error: ErrorEvent | None = None

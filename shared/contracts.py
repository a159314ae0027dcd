"""Typed, versioned messages that cross Redis: job payload, stream events, worker record.

Everything is JSON (pydantic), never pickle. Bump WIRE_VERSION on an incompatible change;
readers reject messages of another major version with a clear error.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator, model_validator

from shared.errors import InvalidRequestError
from shared.tool_format import ToolFormat

WIRE_VERSION = 1

Endpoint = Literal["completions", "chat.completions", "embeddings", "rerank", "score"]
# Endpoints served by embedding and cross-encoder workers: whole inputs in, vectors or
# scores out (no tokens generated, no stream of deltas).
POOLING_ENDPOINTS: frozenset[str] = frozenset({"embeddings", "rerank", "score"})
# What a worker's model does: generate tokens, embed inputs, or score pairs (cross-encoder).
ModelTask = Literal["generate", "embed", "score"]
# Interactive requests run before batch lines, always (queues, admission, the scheduler).
Lane = Literal["interactive", "batch"]
JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
FINAL_STATUSES: frozenset[str] = frozenset({"completed", "failed", "cancelled"})
# A queued job's record, payload and cancel marker must outlive its wait in the queue
# (arq's own job expiry is one day); a started one's too, for a wait after a worker loss.
QUEUED_GRACE_S = 86_400


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=False)
    v: int = WIRE_VERSION


MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0


def check_stops(stops: list[str]) -> list[str]:
    """The rule for stop strings, shared by the HTTP models and the contract."""
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
    if any(not s for s in stops):
        raise ValueError("stop sequences must be non-empty")
    return stops


def check_logit_bias(bias: dict[int, float]) -> dict[int, float]:
    """The rule for logit_bias values, shared by the HTTP models and the contract."""
    for token, value in bias.items():
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise ValueError(f"logit_bias value for {token} must be in [-100, 100]")
    return bias


class SamplingSpec(BaseModel):
    """Sampling parameters, declared once with their ranges (OpenAI's and vLLM's).

    The single source of truth: the HTTP request models (`api/protocol.py`) inherit these
    fields and ranges, the API copies them into the job by name, and the engine's
    `SamplingParams` has the same fields and validates against this model.
    `tests/unit/test_parameters.py` fails when a field exists on one side only.
    """

    model_config = ConfigDict(extra="forbid")

    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # 0 or -1: off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: list[str]) -> list[str]:
        return check_stops(value)

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[int, float]) -> dict[int, float]:
        return check_logit_bias(value)

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingSpec:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self


class StructuredSpec(BaseModel):
    """The constraint on a job's output: an llguidance grammar the API built and checked
    (`shared/grammar.py`), its kind for logs and metrics, and the request field it came from
    (named by a 400 should the worker still reject it)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar", "tool_calls"]
    grammar: str = Field(min_length=1)
    param: str = "response_format"


class ToolCallSpec(BaseModel):
    """How the API reads tool calls out of a chat job's text (`api/tool_calls.py`).

    `auto`: parsed from free output in the model's format (`shared/tool_format.py`); a
    message that is exactly a call to one of `names` (bare, fenced or tagged) is a call too;
    `required`: the output is a grammar-constrained JSON array of calls; `named`: the output
    is the arguments of `function`, grammar-constrained.
    """

    mode: Literal["auto", "required", "named"]
    format: ToolFormat = "hermes"
    function: str | None = None
    names: list[str] = Field(default_factory=list)  # the declared tools (auto)


class PoolingSpec(BaseModel):
    """An embedding or scoring job's inputs beyond their token ids (`JobPayload.prompts`).

    `token_type_batch`: each input's segment ids, for a cross-encoder's (query, document)
    pairs; `dimensions`: Matryoshka truncation of each vector; `pairs`: for rerank and score
    on an embedding model, which inputs' vectors each score compares (cosine).
    """

    token_type_batch: list[list[int]] | None = None
    dimensions: int | None = Field(None, ge=1)
    pairs: list[tuple[int, int]] | None = None
    # how the response carries vectors (the batch collector formats lines from the payload)
    encoding_format: Literal["float", "base64"] = "float"


class PoolingResult(BaseModel):
    """An embedding or scoring job's output: every input's vector as little-endian float32
    (base64, `dims` per vector, in input order), or one score per pair or input."""

    dims: int = 0
    vectors_b64: str | None = None
    scores: list[float] | None = None
    scoring: Literal["cross-encoder", "cosine"] | None = None


class JobPayload(_Wire):
    """One normalised completion request, as the API enqueues it.

    The API tokenizes the prompt once (chat template applied) and sends the token ids; the
    worker runs them as they are and never tokenizes a prompt again. `prompt` (completions
    given as text) and `messages` (chat) are the text, kept for logs and echo.
    """

    id: str
    endpoint: Endpoint
    model: str
    prompt_token_ids: list[int] = Field(min_length=1)
    # Completions given a list of prompts: every prompt's token ids, in order (the first is
    # `prompt_token_ids`); each gets n choices, indexed prompt * n + j as OpenAI does.
    prompt_batch: list[list[int]] | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    echo: bool = False
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    structured: StructuredSpec | None = None
    tool_calls: ToolCallSpec | None = None
    pooling: PoolingSpec | None = None
    stream: bool = False
    priority: int = 0
    lane: Lane = "interactive"
    deadline: float | None = None
    request_id: str | None = None
    api_key_id: str | None = None
    created: float = Field(default_factory=time.time)
    # W3C trace context of the API's request span (shared/tracing.py); None: tracing off.
    traceparent: str | None = None

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt's token ids (one, unless a completions request sent a list)."""
        return self.prompt_batch or [self.prompt_token_ids]

    @property
    def num_choices(self) -> int:
        return self.sampling.n * len(self.prompts)

    @property
    def prompt_param(self) -> str:
        """The request field an error about the prompt names."""
        if self.endpoint in POOLING_ENDPOINTS:
            return "input" if self.endpoint == "embeddings" else "documents"
        return "messages" if self.endpoint == "chat.completions" else "prompt"


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
    """Seconds since the epoch for each milestone of the job's last attempt. The phases
    between them (the console's bar, the trace's spans): queue = queued -> picked (a worker
    took it), setup = picked -> started (handed to the engine), engine queue = started ->
    scheduled (first scheduled), prefill = scheduled -> first token, decode = first token ->
    finished."""

    queued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    picked_at: float | None = None
    scheduled_at: float | None = None


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
    # Tokens of this choice the attempt produced before this delta: a reader drops a delta
    # it already has (a publish retried after Redis took it but the reply was lost).
    pos: int | None = None


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
    pooling: PoolingResult | None = None


class ErrorEvent(_Wire):
    type: Literal["error"] = "error"
    status: int
    error_type: str
    message: str
    param: str | None = None
    code: str | None = None


def error_event(
    exc: Exception,
    status: int = 500,
    error_type: str = "server_error",
    code: str | None = None,
    message: str | None = None,
) -> ErrorEvent:
    """How an exception ends a job: an `InvalidRequestError` as the 400 the API would give
    (its param and code kept); anything else with `status`, `error_type` and `code`."""
    if isinstance(exc, InvalidRequestError):
        return ErrorEvent(
            status=400,
            error_type="invalid_request_error",
            message=exc.message,
            param=exc.param,
            code=exc.code,
        )
    return ErrorEvent(status=status, error_type=error_type, message=message or str(exc), code=code)


def cancelled_event() -> ErrorEvent:
    """How every cancelled job ends, whoever cancels it (the API for a queued job, a worker)."""
    return ErrorEvent(
        status=409, error_type="cancelled", message="The job was cancelled", code="job_cancelled"
    )


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
    model_source: str = ""  # the worker's LLM_MODEL_NAME: where its tokenizer loads from
    task: ModelTask = "generate"
    # embedding models: the vector size, and the Matryoshka sizes (None: no `dimensions`;
    # empty: any size up to `embedding_size`)
    embedding_size: int = 0
    matryoshka_dimensions: list[int] | None = None
    tool_format: ToolFormat | None = None  # the chat template's tool-call syntax
    device: str
    dtype: str
    architecture: str = ""  # the HF class the checkpoint names (e.g. Gemma3ForCausalLM)
    weight_precision: str = ""  # what the weights are held in: the dtype, or int8 / int4
    compiled: bool = False  # forward compiled by inductor (LLM_COMPILE)
    # batch-invariant kernels in use (LLM_DETERMINISTIC); where asked for but not possible, why
    deterministic: bool = False
    deterministic_reason: str = ""
    # batch bucket -> kernels and threads; "forward" -> native, compiled or eager
    kernels: dict[str, str] = Field(default_factory=dict)
    status: Literal["starting", "ready", "draining", "unhealthy"] = "ready"
    max_model_len: int
    block_size: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_bytes_per_block: int = 0
    running: int = 0
    waiting: int = 0
    tokens_per_s: float = 0.0  # generated tokens per second over the last few seconds
    started_at: float = Field(default_factory=time.time)
    heartbeat_at: float = Field(default_factory=time.time)


class PrefixFingerprint(_Wire):
    """What a worker's prefix cache holds (`Keys.prefixes`): a Bloom filter of the chained
    hashes of its cached full blocks (`shared/prefixes.py`), and its room for jobs."""

    worker_id: str
    model: str
    block_size: int
    num_bits: int
    filter: str  # base64 of the filter's bytes
    num_blocks: int = 0  # cached blocks in the filter
    room: int = 0  # interactive jobs it would take now
    running: int = 0  # sequences in the engine
    waiting: int = 0
    published_at: float = Field(default_factory=time.time)


ChildState = Literal["running", "restarting", "given_up", "stopped"]


class ChildStatus(BaseModel):
    """One process `ladle up` supervises, as its supervisor last saw it."""

    name: str
    state: ChildState
    pid: int | None = None
    restarts: int = 0
    recent_crashes: int = 0
    last_exit: str | None = None
    message: str | None = None


class SupervisorRecord(_Wire):
    """What a `ladle up` supervisor says about its children (read by `/ready`)."""

    supervisor_id: str
    host: str
    pid: int
    children: list[ChildStatus] = Field(default_factory=list)
    updated_at: float = Field(default_factory=time.time)


class ModelInfo(_Wire):
    """A served model as its workers last described it (`Keys.models`), so the API knows a
    model whose workers are all away (503, not 404) and where to load its tokenizer."""

    name: str
    source: str
    max_model_len: int
    task: ModelTask = "generate"
    embedding_size: int = 0
    matryoshka_dimensions: list[int] | None = None
    tool_format: ToolFormat | None = None

    @classmethod
    def of(cls, record: WorkerRecord) -> ModelInfo:
        return cls(
            name=record.model,
            source=record.model_source,
            max_model_len=record.max_model_len,
            task=record.task,
            embedding_size=record.embedding_size,
            matryoshka_dimensions=record.matryoshka_dimensions,
            tool_format=record.tool_format,
        )


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
    pooling: PoolingResult | None = None


class TokenReservation(BaseModel):
    """Tokens a job reserved against its key's tokens-per-minute (`shared/ratelimit.py`);
    whoever writes the job's final record gives back what it did not use."""

    bucket: str
    tokens: int
    second: int


class JobRecord(_Wire):
    """The job's state as `GET /v1/jobs/{id}` reads it (stored as JSON under the job key)."""

    id: str
    status: JobStatus = "queued"
    url: str
    model: str
    lane: Lane = "interactive"
    api_key_id: str | None = None
    request_id: str | None = None
    attempts: int = 0
    worker_id: str | None = None
    # the worker the job was held for, whose prefix cache held most of its prompt
    routed_to: str | None = None
    created_at: float = Field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    result: JobResult | None = None
    error: ErrorEvent | None = None
    reservation: TokenReservation | None = None

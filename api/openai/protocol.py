"""OpenAI request bodies (pydantic).

The sampling parameters and their ranges are not declared here: `SamplingFields` inherits
them from the wire contract's `SamplingSpec` (`shared/contracts.py`), overriding only the
fields whose OpenAI shape differs (`stop` may be one string, `logit_bias` keys are strings,
chat's `logprobs` is a flag). Limits that depend on settings (n, logit_bias size) are checked
in `api/openai/prompting.py`. Unknown fields are ignored, as OpenAI clients send fields we
do not use.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from api.openai.protocol_constraints import (
    UNSUPPORTED_FIELDS,
    MessageToolCall,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoice,
    reject_unsupported,
)
from shared.contracts import MAX_LOGPROBS, SamplingSpec, check_logit_bias, check_stops

# Request fields that are not sampling parameters: `api/openai/prompting.py` maps each of them
# (into JobPayload, or into the prompt's tokenization). Every other field is `SamplingSpec`'s;
# tests/unit/test_parameters.py fails on a field that is in neither.
REQUEST_FIELDS = frozenset(
    {
        "model",
        "user",
        "stream",
        "stream_options",
        "priority",
        "prompt",
        "echo",
        "suffix",
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "add_generation_prompt",
        "chat_template_kwargs",
        # structured outputs and tools (api/openai/constraints.py maps them into the job)
        "response_format",
        "structured_outputs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "best_of",
        # accepted for compatibility: prefix caching is automatic; metadata, like user,
        # only labels the request (logged)
        "prompt_cache_key",
        "safety_identifier",
        "metadata",
        # OpenAI fields Ladle does not implement: a 400 unless their value asks for nothing
        *UNSUPPORTED_FIELDS,
    }
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class SamplingFields(SamplingSpec):
    """Fields shared by completions and chat completions: the contract's, plus the request's."""

    # Unknown (vendor) fields are kept aside and logged, once per request, then ignored.
    model_config = ConfigDict(extra="allow", protected_namespaces=())

    model: str | None = None
    stop: str | list[str] | None = None  # type: ignore[assignment]
    logit_bias: dict[str, float] | None = None  # type: ignore[assignment]
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:  # type: ignore[override]
        check_stops([value] if isinstance(value, str) else value or [])
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:  # type: ignore[override]
        for token in value or {}:
            if not token.lstrip("-").isdigit() or int(token) < 0:
                raise ValueError(f"logit_bias key {token!r} is not a token id")
        check_logit_bias(value or {})
        return value

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


MAX_PROMPTS = 64


def _is_prompt_list(value: Any) -> bool:
    """A list of prompts (strings or token-id lists), not one prompt of token ids."""
    return isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @field_validator("prompt")
    @classmethod
    def _check_prompts(cls, value: Any) -> Any:
        prompts = value if _is_prompt_list(value) else [value]
        if len(prompts) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        for prompt in prompts:
            if not prompt:
                raise ValueError("prompt must not be empty")
            if isinstance(prompt, list) and any(t < 0 for t in prompt):
                raise ValueError("token ids must be non-negative")
        return value

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, in order: a list of prompts gets n choices each (index p * n + j)."""
        return list(self.prompt) if _is_prompt_list(self.prompt) else [self.prompt]  # type: ignore[arg-type]

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> None:
        if value:
            raise PydanticCustomError("unsupported_parameter", "suffix is not supported")
        return None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Content parts joined into one string, as chat templates expect; tool calls and
        tool results as the templates that take tools expect them."""
        content = self.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False  # type: ignore[assignment]
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator(*UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        return reject_unsupported(str(info.field_name), value)

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


OpenAIRequest = CompletionRequest | ChatCompletionRequest

URL_TO_ENDPOINT = {"/v1/completions": "completions", "/v1/chat/completions": "chat.completions"}


class JobCreateRequest(_Body):
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]


class BatchCreateRequest(_Body):
    """`POST /v1/batches`, as OpenAI takes it."""

    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions", "/v1/completions"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > 16:
            raise ValueError("at most 16 metadata pairs")
        for key, item in value.items():
            if len(key) > 64 or len(item) > 512:
                raise ValueError("metadata keys are at most 64 characters, values 512")
        return value


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    """Replace `{"$ref": "#/$defs/X"}` by X itself (our request models are not recursive)."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {key: _inline_refs(value, defs) for key, value in node.items()}
    if isinstance(node, list):
        return [_inline_refs(item, defs) for item in node]
    return node


def request_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema, self-contained (no `$defs`), for an OpenAPI request body."""
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop("$defs", {})
    return _inline_refs(schema, defs)


def job_create_schema() -> dict[str, Any]:
    """`POST /v1/jobs`: `body` is a completion or chat completion request."""
    schema = request_schema(JobCreateRequest)
    body = {"anyOf": [request_schema(CompletionRequest), request_schema(ChatCompletionRequest)]}
    schema["properties"]["body"] = {**body, "title": "Body"}
    return schema


def openapi_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that parses its JSON body by hand (see `parse_body`):
    the docs and schema-driven tests see the real request schema, behaviour is unchanged."""
    schema = job_create_schema() if model is JobCreateRequest else request_schema(model)
    content = {"application/json": {"schema": schema}}
    return {"requestBody": {"required": True, "content": content}}

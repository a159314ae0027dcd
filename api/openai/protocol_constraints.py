"""Request parts for structured outputs and tools (OpenAI's and vLLM's shapes), and the
OpenAI fields Ladle does not implement: each is a 400 naming it (`unsupported_parameter`)
unless it holds a value that asks for nothing (`audio: null`, `store: false`, ...)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JSONSchemaFormat(_Part):
    name: str = Field("response", pattern=_FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=lambda: {"type": "object"}, alias="schema")
    strict: bool | None = None  # always enforced: the grammar is the schema


class ResponseFormat(_Part):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class StructuredOutputs(_Part):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


class FunctionDefinition(_Part):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCallFunction(_Part):
    name: str
    arguments: str


class MessageToolCall(_Part):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


# OpenAI request fields not implemented, with the values that ask for nothing.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "functions": (None,),  # deprecated by OpenAI: use tools
    "function_call": (None,),  # deprecated by OpenAI: use tool_choice
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
}


def reject_unsupported(name: str, value: Any) -> Any:
    """The field's value if it asks for nothing, else an `unsupported_parameter` error."""
    if value not in UNSUPPORTED_FIELDS[name]:
        raise PydanticCustomError(
            "unsupported_parameter", f"{name} is not supported by this server"
        )
    return value

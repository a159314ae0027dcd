"""Request bodies of `/v1/embeddings` (OpenAI's), `/v1/rerank` (the shape vLLM, Jina and
Cohere share) and `/v1/score` (vLLM's). Unknown fields are ignored, as elsewhere."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# OpenAI's cap on inputs per embeddings request; rerank and score take as many documents.
MAX_INPUTS = 2048


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    model: str | None = None
    user: str | None = None
    priority: int = 0
    # vLLM's: cut each input to its first k tokens (-1: the model's context) instead of a 400
    truncate_prompt_tokens: int | None = Field(None, ge=-1)

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be -1 or at least 1")
        return value


class EmbeddingRequest(_Body):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)

    @field_validator("input")
    @classmethod
    def _check_input(
        cls, value: str | list[str] | list[int] | list[list[int]]
    ) -> str | list[str] | list[int] | list[list[int]]:
        items = [value] if isinstance(value, str) else value
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_INPUTS and not isinstance(items[0], int):
            raise ValueError(f"at most {MAX_INPUTS} inputs per request")
        if any(isinstance(i, str | list) and len(i) == 0 for i in items):
            raise ValueError("input must not contain empty strings or token lists")
        return value

    def inputs(self) -> list[str] | list[list[int]]:
        """Every input: texts, or token-id lists (one list of ids is one input)."""
        value = self.input
        if isinstance(value, str):
            return [value]
        if isinstance(value[0], int):
            return [value]  # type: ignore[list-item]
        return value  # type: ignore[return-value]


class Document(BaseModel):
    text: str


class RerankRequest(_Body):
    query: str = Field(min_length=1)
    documents: list[str | Document] = Field(min_length=1, max_length=MAX_INPUTS)
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(_Body):
    text_1: str | list[str]
    text_2: str | list[str]

    def pairs(self) -> list[tuple[str, str]]:
        """vLLM's pairing: one against many, or many against as many, in order."""
        left = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        right = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if not left or not right:
            raise ValueError("text_1 and text_2 must not be empty")
        if len(left) == 1:
            return [(left[0], r) for r in right]
        if len(left) != len(right):
            raise ValueError("text_1 and text_2 must have the same length, or text_1 one item")
        return list(zip(left, right, strict=True))

"""Embedding, rerank and score bodies -> one job each: the model's task checked, every input
tokenized once (pairs as the cross-encoder's tokenizer joins them), lengths and
`dimensions` checked before the job exists."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from api.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from api.errors import APIError
from api.jobs.store import new_job_id
from api.openai.prompting import clamp_priority
from api.services import Services
from shared.contracts import Endpoint, JobPayload, Lane, ModelInfo, PoolingSpec
from shared.errors import InvalidRequestError, check_input_length
from shared.logging import request_id_var

# endpoint -> the model tasks that serve it (rerank and score fall back to cosine)
TASKS = {"embeddings": ("embed",), "rerank": ("score", "embed"), "score": ("score", "embed")}
PoolingBody = EmbeddingRequest | RerankRequest | ScoreRequest


@dataclass
class JobOptions:
    """Where a job comes from: the caller's key and range, its lane and deadline."""

    api_key_id: str | None
    priority_range: tuple[int, int]
    lane: Lane = "interactive"
    deadline_s: float | None = None
    job_id: str | None = None


async def resolve_model(
    services: Services, body: PoolingBody, endpoint: Endpoint, lane: Lane
) -> ModelInfo:
    """The named model, which must embed (or score, for rerank and score): else a 400."""
    model = await services.workers.resolve(
        body.model, services.settings.model_id, require_live=lane == "interactive"
    )
    if model.task not in TASKS[endpoint]:
        raise APIError(
            400,
            f"The model `{model.name}` does not serve /v1/{endpoint} (it is a "
            f"{'text generation' if model.task == 'generate' else model.task} model)",
            param="model",
            code="model_not_supported",
        )
    return model


def token_limit(body: PoolingBody, model: ModelInfo) -> int | None:
    """How many tokens an input may keep (None: no truncation asked, longer is a 400)."""
    asked = body.truncate_prompt_tokens
    if asked is None:
        return None
    if asked > model.max_model_len:
        raise APIError(
            400,
            f"truncate_prompt_tokens ({asked}) is larger than the model's context "
            f"({model.max_model_len})",
            param="truncate_prompt_tokens",
        )
    return model.max_model_len if asked == -1 else asked


def _checked(ids: list[list[int]], model: ModelInfo, param: str) -> list[list[int]]:
    for item in ids:
        try:
            check_input_length(len(item), model.max_model_len, param)
        except InvalidRequestError as exc:
            raise APIError(400, exc.message, param=exc.param, code=exc.code) from None
    return ids


async def encode_texts(
    services: Services, model: ModelInfo, texts: list[str], limit: int | None, param: str
) -> list[list[int]]:
    tokenizer = await services.tokenizer.get(model.name)
    encoded = await asyncio.to_thread(
        tokenizer.hf, texts, truncation=limit is not None, max_length=limit
    )
    return _checked([list(x) for x in encoded["input_ids"]], model, param)


async def encode_pairs(
    services: Services, model: ModelInfo, pairs: list[tuple[str, str]], limit: int | None
) -> tuple[list[list[int]], list[list[int]] | None]:
    """Each (query, document) as one input with its segment ids, the cross-encoder's way."""
    tokenizer = await services.tokenizer.get(model.name)
    left, right = [p[0] for p in pairs], [p[1] for p in pairs]
    encoded = await asyncio.to_thread(
        tokenizer.hf, left, right, truncation=limit is not None, max_length=limit
    )
    ids = _checked([list(x) for x in encoded["input_ids"]], model, "documents")
    types = encoded.get("token_type_ids")
    return ids, [list(t) for t in types] if types is not None else None


async def token_inputs(
    services: Services, model: ModelInfo, inputs: list[list[int]], limit: int | None
) -> list[list[int]]:
    """Token-id inputs as given (cut to `limit`), each id checked against the vocabulary."""
    tokenizer = await services.tokenizer.get(model.name)
    if any(not 0 <= t < tokenizer.vocab_size for ids in inputs for t in ids):
        raise APIError(400, f"token ids must be in [0, {tokenizer.vocab_size})", param="input")
    cut = [ids[:limit] if limit else ids for ids in inputs]
    return _checked(cut, model, "input")


def check_dimensions(dimensions: int | None, model: ModelInfo) -> None:
    if dimensions is None:
        return
    allowed = model.matryoshka_dimensions
    if allowed is None:
        raise APIError(
            400,
            f"The model `{model.name}` does not support truncating its embeddings "
            "('dimensions'): it was not trained for it (Matryoshka)",
            param="dimensions",
        )
    if dimensions > model.embedding_size or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {model.embedding_size}"
        raise APIError(400, f"dimensions must be one of: {sizes}", param="dimensions")


def build_payload(
    endpoint: Endpoint,
    model: ModelInfo,
    inputs: list[list[int]],
    spec: PoolingSpec,
    body: PoolingBody,
    options: JobOptions,
    text: str | None = None,
) -> JobPayload:
    common: dict[str, Any] = {
        "id": options.job_id or new_job_id(),
        "endpoint": endpoint,
        "model": model.name,
        "prompt_token_ids": inputs[0],
        "prompt_batch": inputs if len(inputs) > 1 else None,
        "prompt": text,
        "pooling": spec,
        "priority": clamp_priority(body.priority, options.priority_range),
        "lane": options.lane,
        "deadline": time.time() + options.deadline_s if options.deadline_s else None,
        "request_id": request_id_var.get(),
        "api_key_id": options.api_key_id,
    }
    return JobPayload(**common)

"""Prepare an embedding, rerank or score job, and run one to its end for a response.

The job goes through the same queue, admission, rate limits and job records as a
completion; its `done` event carries the vectors or scores (no deltas come before it).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Request

from api.embeddings.inputs import (
    JobOptions,
    build_payload,
    check_dimensions,
    encode_pairs,
    encode_texts,
    resolve_model,
    token_inputs,
    token_limit,
)
from api.embeddings.openai_ids import ids_to_texts
from api.embeddings.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from api.errors import APIError
from api.services import Services
from shared.contracts import DoneEvent, Endpoint, ErrorEvent, JobPayload, PoolingSpec


async def prepare_embedding(
    services: Services, body: EmbeddingRequest, options: JobOptions
) -> JobPayload:
    model = await resolve_model(services, body, "embeddings", options.lane)
    check_dimensions(body.dimensions, model)
    limit = token_limit(body, model)
    items = body.inputs()
    if not isinstance(items[0], str) and services.settings.embedding_token_ids == "cl100k_base":
        items = ids_to_texts(items)  # type: ignore[arg-type]
    if isinstance(items[0], str):
        ids = await encode_texts(services, model, items, limit, "input")  # type: ignore[arg-type]
    else:
        ids = await token_inputs(services, model, items, limit)  # type: ignore[arg-type]
    text = items[0] if len(items) == 1 and isinstance(items[0], str) else None
    spec = PoolingSpec(dimensions=body.dimensions, encoding_format=body.encoding_format)
    return build_payload("embeddings", model, ids, spec, body, options, text)


def ranking_pairs(endpoint: Endpoint, body: RerankRequest | ScoreRequest) -> list[tuple[str, str]]:
    if isinstance(body, RerankRequest):
        return [(body.query, text) for text in body.texts()]
    try:
        return body.pairs()
    except ValueError as exc:
        raise APIError(400, str(exc), param="text_2") from None


async def prepare_ranking(
    services: Services, endpoint: Endpoint, body: RerankRequest | ScoreRequest, options: JobOptions
) -> JobPayload:
    """A cross-encoder scores each (query, document) pair as one input; an embedding model
    embeds every distinct text once and the worker compares the pairs' vectors (cosine)."""
    model = await resolve_model(services, body, endpoint, options.lane)
    limit = token_limit(body, model)
    pairs = ranking_pairs(endpoint, body)
    if model.task == "score":
        ids, types = await encode_pairs(services, model, pairs, limit)
        spec = PoolingSpec(token_type_batch=types)
        return build_payload(endpoint, model, ids, spec, body, options)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    place = {text: i for i, text in enumerate(texts)}
    ids = await encode_texts(services, model, texts, limit, "documents")
    spec = PoolingSpec(pairs=[(place[a], place[b]) for a, b in pairs])
    return build_payload(endpoint, model, ids, spec, body, options)


async def run_job(request: Request, services: Services, payload: JobPayload, url: str) -> DoneEvent:
    """Submit, then wait for the job's `done` (a restarted attempt just waits on); its
    `error` is the response, a client that leaves cancels it."""
    deadline = time.monotonic() + services.settings.request_timeout_s
    sub = services.relay.subscribe(payload.id)
    try:
        await services.jobs.submit(payload, url, getattr(request.state, "quota", None))
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            _, event = await sub.next(remaining)
            if isinstance(event, DoneEvent):
                return event
            if isinstance(event, ErrorEvent):
                error = APIError.from_event(event)
                error.headers["X-Job-Id"] = payload.id
                raise error
    except TimeoutError as exc:
        services.jobs.cancel_soon(payload.id)
        raise APIError(504, "The request timed out", code="timeout") from exc
    except asyncio.CancelledError:
        if not services.relay.closing:  # a client that went away: nothing waits for it
            services.jobs.cancel_soon(payload.id)
        raise
    finally:
        services.relay.unsubscribe(sub)

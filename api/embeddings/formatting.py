"""A finished embedding or scoring job -> the response its endpoint returns."""

from __future__ import annotations

import base64
import struct
import time
from typing import Any

from api.embeddings.protocol import RerankRequest
from api.jobs.routes import POOLED_RESPONSES
from shared.contracts import JobPayload, JobResult, PoolingResult, Usage


def vector_bytes(result: PoolingResult) -> list[bytes]:
    """Each vector's little-endian float32 bytes, in input order."""
    raw = base64.b64decode(result.vectors_b64 or "")
    size = 4 * result.dims
    return [raw[i : i + size] for i in range(0, len(raw), size)] if size else []


def _usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens}


def embedding_response(
    model: str, result: PoolingResult, usage: Usage, encoding_format: str
) -> dict[str, Any]:
    """OpenAI's list of embeddings: floats, or base64 of the float32 bytes."""
    data = []
    for index, raw in enumerate(vector_bytes(result)):
        if encoding_format == "base64":
            embedding: Any = base64.b64encode(raw).decode()
        else:
            embedding = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        data.append({"object": "embedding", "index": index, "embedding": embedding})
    return {"object": "list", "data": data, "model": model, "usage": _usage(usage)}


def rerank_response(
    job_id: str, model: str, result: PoolingResult, usage: Usage, body: RerankRequest
) -> dict[str, Any]:
    """Documents by relevance, best first; `scoring` says whether a cross-encoder scored
    the pairs or the cosine of an embedding model's vectors did."""
    texts = body.texts()
    scores = result.scores or []
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or len(scores)]
    results = []
    for index in order:
        item: dict[str, Any] = {"index": index, "relevance_score": scores[index]}
        if body.return_documents:
            item["document"] = {"text": texts[index]}
        results.append(item)
    return {
        "id": job_id,
        "model": model,
        "scoring": result.scoring,
        "usage": {"prompt_tokens": usage.prompt_tokens, "total_tokens": usage.prompt_tokens},
        "results": results,
    }


def score_response(job_id: str, model: str, result: PoolingResult, usage: Usage) -> dict[str, Any]:
    """vLLM's score list: one score per pair, in order."""
    data = [
        {"index": i, "object": "score", "score": score}
        for i, score in enumerate(result.scores or [])
    ]
    return {
        "id": job_id,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "scoring": result.scoring,
        "data": data,
        "usage": _usage(usage),
    }


def _job_embeddings(payload: JobPayload, result: JobResult) -> dict[str, Any]:
    encoding = payload.pooling.encoding_format if payload.pooling else "float"
    pooled = result.pooling or PoolingResult()
    return embedding_response(payload.model, pooled, result.usage, encoding)


def _job_rerank(payload: JobPayload, result: JobResult) -> dict[str, Any]:
    """Every document by relevance, best first (the request's top_n and texts are not kept)."""
    pooled = result.pooling or PoolingResult()
    scores = pooled.scores or []
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    return {
        "id": payload.id,
        "model": payload.model,
        "scoring": pooled.scoring,
        "usage": _usage(result.usage),
        "results": [{"index": i, "relevance_score": scores[i]} for i in order],
    }


def _job_score(payload: JobPayload, result: JobResult) -> dict[str, Any]:
    pooled = result.pooling or PoolingResult()
    return score_response(payload.id, payload.model, pooled, result.usage)


# `GET /v1/jobs/{id}` answers a finished pooling job with its endpoint's response
POOLED_RESPONSES.update(embeddings=_job_embeddings, rerank=_job_rerank, score=_job_score)

"""The OpenAI surface: completions, chat completions, models, tokenize/detokenize."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from api.auth import ApiKeyId, require_api_key
from api.errors import APIError, model_not_found
from api.openai.admission import parse_body
from api.openai.completions import complete
from api.openai.prompting import prompt_token_ids
from api.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    openapi_body,
)
from api.services import Services, ServicesDep

router = APIRouter()


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionRequest))
async def completions(
    request: Request,
    api_key_id: ApiKeyId,
    services: ServicesDep,
) -> Response:
    body = await parse_body(request, CompletionRequest)
    return await complete(request, services, body, api_key_id)


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionRequest))
async def chat_completions(
    request: Request,
    api_key_id: ApiKeyId,
    services: ServicesDep,
) -> Response:
    body = await parse_body(request, ChatCompletionRequest)
    return await complete(request, services, body, api_key_id)


@router.get("/v1/models", dependencies=[Depends(require_api_key)])
async def models(services: ServicesDep) -> dict:
    served = await services.workers.models()
    described = await services.workers.descriptions()
    known = await services.workers.known()
    data = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "ladle",
            "root": name,
            "max_model_len": max_model_len,
            **described.get(name, {}),
            "tool_format": known[name].tool_format if name in known else None,
        }
        for name, max_model_len in sorted(served.items())
    ]
    return {"object": "list", "data": data}


async def _model_len(services: Services, requested: str | None) -> int | None:
    """max_model_len for tokenize; works without workers for the configured model."""
    served = await services.workers.models()
    name = requested or services.settings.model_id
    if name in served:
        return served[name]
    if served or name != services.settings.model_id:
        raise model_not_found(name)
    return services.settings.max_model_len


@router.post(
    "/tokenize",
    dependencies=[Depends(require_api_key)],
    openapi_extra=openapi_body(TokenizeRequest),
)
async def tokenize(request: Request, services: ServicesDep) -> dict:
    body = await parse_body(request, TokenizeRequest)
    max_model_len = await _model_len(services, body.model)
    tokenizer = await services.tokenizer.get(body.model)
    if body.messages is not None:
        chat = ChatCompletionRequest(
            messages=body.messages, add_generation_prompt=body.add_generation_prompt
        )
        tokens = await prompt_token_ids(tokenizer, chat)
    else:
        tokens = await asyncio.to_thread(
            tokenizer.encode, body.prompt or "", add_special_tokens=body.add_special_tokens
        )
    return {"tokens": tokens, "count": len(tokens), "max_model_len": max_model_len}


@router.post(
    "/detokenize",
    dependencies=[Depends(require_api_key)],
    openapi_extra=openapi_body(DetokenizeRequest),
)
async def detokenize(request: Request, services: ServicesDep) -> dict:
    body = await parse_body(request, DetokenizeRequest)
    await _model_len(services, body.model)
    tokenizer = await services.tokenizer.get(body.model)
    try:
        text = await asyncio.to_thread(tokenizer.decode, body.tokens)
    except (ValueError, OverflowError, TypeError) as exc:
        raise APIError(400, f"Cannot decode tokens: {exc}", param="tokens") from exc
    return {"prompt": text}

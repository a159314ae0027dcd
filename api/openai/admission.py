"""An OpenAI body -> a job payload: every check (limits, model, output constraints, prompt
length) done before the job exists. The completions, jobs and batch routes all start here."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from api.errors import validation_error
from api.jobs.store import new_job_id
from api.openai.constraints import (
    auto_tools_spec,
    check_request,
    output_spec,
    with_tool_format,
)
from api.openai.formatting import ResponseContext
from api.openai.prompting import build_payload, check_context, check_limits, prompts_token_ids
from api.openai.protocol import ChatCompletionRequest, OpenAIRequest
from api.services import Services
from shared.contracts import JobPayload, Lane
from shared.logging import request_id_var

M = TypeVar("M", bound=BaseModel)


async def parse_body(request: Request, model: type[M]) -> M:
    """Validate the raw body ourselves, so every failure is a 400 in OpenAI's shape."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc) from exc


def parse_dict(body: dict[str, Any], model: type[M]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from exc


async def prepare_job(
    services: Services,
    body: OpenAIRequest,
    *,
    api_key_id: str | None,
    deadline_s: float | None,
    job_id: str | None = None,
    lane: Lane = "interactive",
    priority_range: tuple[int, int] | None = None,
) -> JobPayload:
    """Limits, model, output constraints, prompt length: all checked before a job exists.

    A batch line (`lane="batch"`) may name a model whose workers are all away for now: it
    waits in that model's queue instead of failing."""
    settings = services.settings
    check_limits(body, settings)
    check_request(body)
    # Checking a new schema takes milliseconds: off the event loop.
    structured, tool_calls = await asyncio.to_thread(output_spec, body)
    model = await services.workers.resolve(
        body.model, settings.model_id, require_live=lane == "interactive"
    )
    tokenizer = await services.tokenizer.get(model.name)
    prompts = await prompts_token_ids(tokenizer, body)
    param = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    max_tokens = min(
        check_context(len(ids), body.max_tokens, model.max_model_len, param) for ids in prompts
    )
    prompt_ids = prompts[0]
    tool_calls = with_tool_format(tool_calls, tokenizer)
    structured = await asyncio.to_thread(auto_tools_spec, body, structured, tool_calls)
    return build_payload(
        body,
        prompt_batch=prompts if len(prompts) > 1 else None,
        structured=structured,
        tool_calls=tool_calls,
        prompt_token_ids=prompt_ids,
        job_id=job_id or new_job_id(),
        model=model.name,
        max_tokens=max_tokens,
        deadline_s=deadline_s,
        request_id=request_id_var.get(),
        api_key_id=api_key_id,
        priority_range=priority_range or (settings.priority_min, settings.priority_max),
        lane=lane,
    )


async def echo_texts(services: Services, payload: JobPayload) -> list[str] | None:
    """The prompt text that `echo` puts in front of each prompt's completions."""
    if payload.endpoint != "completions" or not payload.echo:
        return None
    if payload.prompt is not None and payload.prompt_batch is None:
        return [payload.prompt]
    tokenizer = await services.tokenizer.get(payload.model)
    return [await asyncio.to_thread(tokenizer.decode, ids) for ids in payload.prompts]


async def response_context(
    services: Services, payload: JobPayload, include_usage: bool
) -> ResponseContext:
    return ResponseContext(
        endpoint=payload.endpoint,
        job_id=payload.id,
        model=payload.model,
        created=int(payload.created),
        n=payload.num_choices,
        choices_per_prompt=payload.sampling.n,
        echo_texts=await echo_texts(services, payload),
        include_usage=include_usage,
        tool_calls=payload.tool_calls,
    )


def allowed_priorities(request: Request) -> tuple[int, int] | None:
    """The `priority` range of the caller's key (None: the settings' range)."""
    quota = getattr(request.state, "quota", None)
    return quota.policy.priority_range if quota is not None else None

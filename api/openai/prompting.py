"""Requests -> JobPayload: the one tokenization of a prompt (the tokenizer is loaded once, off
the event loop), the context-length check against the live worker's max_model_len, and the
settings-dependent limits."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from api.errors import APIError
from api.openai.constraints import chat_inputs
from api.openai.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from shared.config import Settings
from shared.contracts import JobPayload, Lane, SamplingSpec, StructuredSpec, ToolCallSpec
from shared.errors import InvalidRequestError, check_context_length

log = logging.getLogger(__name__)


def _default_loader(settings: Settings) -> Any:
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(settings.model_name, cache_dir=settings.cache_dir)


class TokenizerHolder:
    """Each model's tokenizer, loaded lazily (once per process and model) in a thread.

    The configured model loads from LLM_MODEL_NAME; any other from the source its workers
    report (`sources`), so the API must read the same path (docker: the same volume)."""

    def __init__(
        self,
        settings: Settings,
        loader: Callable[[Settings], Any] | None = None,
        sources: Callable[[str], Awaitable[str | None]] | None = None,
    ) -> None:
        self._settings = settings
        self._loader = loader or _default_loader
        self._sources = sources
        self._tasks: dict[str, asyncio.Task] = {}

    def preload(self) -> None:
        """Start loading the configured model's tokenizer so the first request does not wait."""
        self._start(self._settings.model_id, self._settings)

    def _start(self, model: str, settings: Settings) -> asyncio.Task:
        if model not in self._tasks:
            self._tasks[model] = asyncio.create_task(asyncio.to_thread(self._loader, settings))
        return self._tasks[model]

    async def _settings_for(self, model: str) -> Settings:
        if model == self._settings.model_id or self._sources is None:
            return self._settings
        source = await self._sources(model)
        if source is None:
            raise APIError(503, f"The tokenizer of `{model}` is unknown", code="tokenizer_error")
        return self._settings.model_copy(update={"model_name": source})

    async def get(self, model: str | None = None) -> Any:
        model = model or self._settings.model_id
        task = self._tasks.get(model) or self._start(model, await self._settings_for(model))
        try:
            return await asyncio.shield(task)
        except Exception as exc:
            log.error("tokenizer failed to load", extra={"model": model, "error": repr(exc)})
            self._tasks.pop(model, None)  # try again on the next request
            raise APIError(
                503, "The tokenizer could not be loaded", code="tokenizer_error"
            ) from exc


async def prompt_token_ids(tokenizer: Any, request: OpenAIRequest) -> list[int]:
    """The prompt as the worker will see it (chat template applied)."""
    if isinstance(request, ChatCompletionRequest):
        try:
            messages, tool_kwargs = await asyncio.to_thread(chat_inputs, tokenizer, request)
            return await asyncio.to_thread(
                tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=request.add_generation_prompt,
                **{**request.chat_template_kwargs, **tool_kwargs},
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_chat_template") from exc
    return (await prompts_token_ids(tokenizer, request))[0]


async def prompts_token_ids(tokenizer: Any, request: OpenAIRequest) -> list[list[int]]:
    """Every prompt's token ids: one for chat, one per prompt in a completions list."""
    if isinstance(request, ChatCompletionRequest):
        return [await prompt_token_ids(tokenizer, request)]
    return [
        list(prompt)
        if isinstance(prompt, list)
        else await asyncio.to_thread(tokenizer.encode, prompt, add_special_tokens=True)
        for prompt in request.prompt_list()
    ]


def check_context(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> int:
    """The shared context-length check (`shared/errors.py`) as an API error."""
    try:
        return check_context_length(num_prompt_tokens, max_tokens, max_model_len, param)
    except InvalidRequestError as exc:
        raise APIError(400, exc.message, param=exc.param, code=exc.code) from None


def check_limits(request: OpenAIRequest, settings: Settings) -> None:
    """The limits that come from settings rather than the OpenAI schema."""
    if request.n > settings.max_n:
        raise APIError(400, f"n must be at most {settings.max_n}", param="n", code="invalid_n")
    if request.logit_bias and len(request.logit_bias) > settings.max_logit_bias:
        raise APIError(
            400,
            f"logit_bias may hold at most {settings.max_logit_bias} entries",
            param="logit_bias",
            code="invalid_logit_bias",
        )


def _logprobs(request: OpenAIRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def sampling_spec(request: OpenAIRequest, max_tokens: int) -> SamplingSpec:
    """OpenAI fields -> SamplingSpec, by name; only fields whose HTTP shape differs are mapped
    here. A missing seed becomes a random one (see DESIGN.md)."""
    fields = request.model_dump(include=set(SamplingSpec.model_fields))
    fields.update(
        seed=request.seed if request.seed is not None else secrets.randbelow(2**31),
        max_tokens=max_tokens,
        stop=request.stop_list(),
        logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()},
        logprobs=_logprobs(request),
    )
    return SamplingSpec.model_validate(fields)


def clamp_priority(priority: int, allowed: tuple[int, int]) -> int:
    """A client's `priority` within the range its key may use (lower runs first)."""
    low, high = allowed
    return min(max(priority, low), high)


def build_payload(
    request: OpenAIRequest,
    *,
    structured: StructuredSpec | None = None,
    tool_calls: ToolCallSpec | None = None,
    prompt_batch: list[list[int]] | None = None,
    prompt_token_ids: list[int],
    job_id: str,
    model: str,
    max_tokens: int,
    deadline_s: float | None,
    request_id: str | None,
    api_key_id: str | None,
    priority_range: tuple[int, int],
    lane: Lane = "interactive",
) -> JobPayload:
    """The normalised job the worker runs: token ids to run, text for logs and echo."""
    common: dict[str, Any] = {
        "id": job_id,
        "model": model,
        "prompt_token_ids": prompt_token_ids,
        "sampling": sampling_spec(request, max_tokens),
        "structured": structured,
        "prompt_batch": prompt_batch,
        "tool_calls": tool_calls,
        "stream": request.stream,
        "priority": clamp_priority(request.priority, priority_range),
        "lane": lane,
        "deadline": time.time() + deadline_s if deadline_s else None,
        "request_id": request_id,
        "api_key_id": api_key_id,
    }
    if isinstance(request, CompletionRequest):
        text = request.prompt if isinstance(request.prompt, str) else None
        return JobPayload(endpoint="completions", prompt=text, echo=request.echo, **common)
    messages = [m.as_dict() for m in request.messages]
    return JobPayload(endpoint="chat.completions", messages=messages, **common)

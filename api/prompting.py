"""Requests -> JobPayload: the one tokenization of a prompt (the tokenizer is loaded once, off
the event loop), the context-length check against the live worker's max_model_len, and the
settings-dependent limits."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from api.errors import APIError
from api.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from shared.config import Settings
from shared.contracts import JobPayload, SamplingSpec
from shared.errors import InvalidRequestError, check_context_length

log = logging.getLogger(__name__)


def _default_loader(settings: Settings) -> Any:
    from shared.tokenizer import load_tokenizer

    return load_tokenizer(settings.model_name, cache_dir=settings.cache_dir)


class TokenizerHolder:
    """Loads the tokenizer lazily, once per process, in a thread."""

    def __init__(self, settings: Settings, loader: Callable[[Settings], Any] | None = None) -> None:
        self._settings = settings
        self._loader = loader or _default_loader
        self._task: asyncio.Task | None = None

    def preload(self) -> None:
        """Start loading in the background so the first request does not pay for it."""
        if self._task is None:
            self._task = asyncio.create_task(asyncio.to_thread(self._loader, self._settings))

    async def get(self) -> Any:
        self.preload()
        assert self._task is not None
        try:
            return await asyncio.shield(self._task)
        except Exception as exc:
            log.error("tokenizer failed to load", extra={"error": repr(exc)})
            self._task = None  # try again on the next request
            raise APIError(
                503, "The tokenizer could not be loaded", code="tokenizer_error"
            ) from exc


async def prompt_token_ids(tokenizer: Any, request: OpenAIRequest) -> list[int]:
    """The prompt as the worker will see it (chat template applied)."""
    if isinstance(request, ChatCompletionRequest):
        messages = [m.as_dict() for m in request.messages]
        try:
            return await asyncio.to_thread(
                tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=request.add_generation_prompt,
                **request.chat_template_kwargs,
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages", code="invalid_chat_template") from exc
    if isinstance(request.prompt, list):
        return list(request.prompt)
    return await asyncio.to_thread(tokenizer.encode, request.prompt, add_special_tokens=True)


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


def build_payload(
    request: OpenAIRequest,
    *,
    prompt_token_ids: list[int],
    job_id: str,
    model: str,
    max_tokens: int,
    deadline_s: float | None,
    request_id: str | None,
    api_key_id: str | None,
) -> JobPayload:
    """The normalised job the worker runs: token ids to run, text for logs and echo."""
    common: dict[str, Any] = {
        "id": job_id,
        "model": model,
        "prompt_token_ids": prompt_token_ids,
        "sampling": sampling_spec(request, max_tokens),
        "stream": request.stream,
        "priority": request.priority,
        "deadline": time.time() + deadline_s if deadline_s else None,
        "request_id": request_id,
        "api_key_id": api_key_id,
    }
    if isinstance(request, CompletionRequest):
        text = request.prompt if isinstance(request.prompt, str) else None
        return JobPayload(endpoint="completions", prompt=text, echo=request.echo, **common)
    messages = [m.as_dict() for m in request.messages]
    return JobPayload(endpoint="chat.completions", messages=messages, **common)

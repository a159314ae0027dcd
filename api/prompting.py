"""Requests -> JobPayload: the tokenizer (loaded once, off the event loop), context-length
checks against the live worker's max_model_len, and the settings-dependent limits."""

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
    """Raise OpenAI's context_length_exceeded 400; return max_tokens (default: what fits)."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    noun = "messages" if param == "messages" else "prompt"
    if num_prompt_tokens >= max_model_len:
        raise APIError(
            400,
            head + f"your {noun} has {num_prompt_tokens} tokens. "
            f"Please reduce the length of the {noun}.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise APIError(
            400,
            head + f"you requested {num_prompt_tokens + max_tokens} tokens "
            f"({num_prompt_tokens} in the {noun}, {max_tokens} in the completion). "
            f"Please reduce the length of the {noun} or completion.",
            param=param,
            code="context_length_exceeded",
        )
    return max_tokens if max_tokens is not None else max_model_len - num_prompt_tokens


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
    """OpenAI fields -> SamplingSpec; a missing seed becomes a random one (see DESIGN.md)."""
    seed = request.seed if request.seed is not None else secrets.randbelow(2**31)
    return SamplingSpec(
        n=request.n,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        repetition_penalty=request.repetition_penalty,
        logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()},
        seed=seed,
        max_tokens=max_tokens,
        min_tokens=request.min_tokens,
        stop=request.stop_list(),
        stop_token_ids=request.stop_token_ids,
        ignore_eos=request.ignore_eos,
        logprobs=_logprobs(request),
        include_stop_str_in_output=request.include_stop_str_in_output,
        skip_special_tokens=request.skip_special_tokens,
    )


def build_payload(
    request: OpenAIRequest,
    *,
    job_id: str,
    model: str,
    max_tokens: int,
    deadline_s: float | None,
    request_id: str | None,
    api_key_id: str | None,
) -> JobPayload:
    """The normalised job the worker runs."""
    common: dict[str, Any] = {
        "id": job_id,
        "model": model,
        "sampling": sampling_spec(request, max_tokens),
        "stream": request.stream,
        "priority": request.priority,
        "deadline": time.time() + deadline_s if deadline_s else None,
        "request_id": request_id,
        "api_key_id": api_key_id,
    }
    if isinstance(request, CompletionRequest):
        return JobPayload(
            endpoint="completions", prompt=request.prompt, echo=request.echo, **common
        )
    return JobPayload(
        endpoint="chat.completions",
        messages=[m.as_dict() for m in request.messages],
        add_generation_prompt=request.add_generation_prompt,
        chat_template_kwargs=request.chat_template_kwargs,
        **common,
    )

"""Errors the engine reports about a request; the worker turns them into 4xx error events."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request cannot run as given (maps to HTTP 400, OpenAI invalid_request_error)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def context_length_error(
    max_model_len: int, num_prompt: int, max_tokens: int | None, param: str = "prompt"
) -> InvalidRequestError:
    """OpenAI's wording for a request that does not fit the context window."""
    if max_tokens is None:
        detail = f"However, your prompt has {num_prompt} tokens, leaving no room for a completion."
    else:
        detail = (
            f"However, you requested {num_prompt + max_tokens} tokens "
            f"({num_prompt} in the prompt, {max_tokens} for the completion)."
        )
    return InvalidRequestError(
        f"This model's maximum context length is {max_model_len} tokens. {detail} "
        "Please reduce the length of the prompt or the completion.",
        param=param,
        code="context_length_exceeded",
    )

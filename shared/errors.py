"""Request errors both sides raise: one exception type, one context-length check and wording.

The API raises them before a job exists (they become a 400 by its error handler); the
engine raises them for requests that reach it otherwise (offline use, a changed model).
"""

from __future__ import annotations

# A process's exit status for "cannot run as configured" (sysexits' EX_CONFIG): a worker whose
# model cannot be served exits with it, and `ladle up` stops rather than restart it.
EXIT_CONFIG_ERROR = 78


class InvalidRequestError(ValueError):
    """The request cannot run as given (HTTP 400, OpenAI invalid_request_error)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str = "prompt"
) -> int:
    """Raise OpenAI's context_length_exceeded; return max_tokens (default: what fits)."""
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    noun = "messages" if param == "messages" else "prompt"
    if num_prompt_tokens >= max_model_len:
        detail = (
            f"your {noun} has {num_prompt_tokens} tokens. Please reduce the length of the {noun}."
        )
    elif max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        detail = (
            f"you requested {num_prompt_tokens + max_tokens} tokens "
            f"({num_prompt_tokens} in the {noun}, {max_tokens} in the completion). "
            f"Please reduce the length of the {noun} or completion."
        )
    else:
        return max_tokens if max_tokens is not None else max_model_len - num_prompt_tokens
    raise InvalidRequestError(head + detail, param=param, code="context_length_exceeded")


def check_input_length(num_tokens: int, max_model_len: int, param: str = "input") -> None:
    """Raise context_length_exceeded for an embedding or scoring input longer than the model
    takes (nothing is generated, so an input may fill the whole context)."""
    if num_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"input has {num_tokens} tokens. Please reduce the length of the input, or set "
            "truncate_prompt_tokens.",
            param=param,
            code="context_length_exceeded",
        )

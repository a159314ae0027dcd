"""Turn a prompt (text or token ids) or chat messages into prompt token ids."""

from __future__ import annotations

from typing import Any

from shared.errors import InvalidRequestError
from shared.tokenizer import Tokenizer


def tokenize_prompt(
    tokenizer: Tokenizer,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Apply the chat template to messages, or encode the prompt; errors name the field."""
    if messages is not None:
        if not messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="messages") from exc
    if isinstance(prompt, list):
        if not prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return list(prompt)
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    return tokenizer.encode(prompt)

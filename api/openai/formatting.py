"""Worker events and results -> OpenAI objects: one builder for responses, one for chunks,
each serving both completions and chat completions."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from api.openai.tool_calls import ToolCallParser, merge_deltas
from shared.contracts import (
    ChoiceResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    RestartEvent,
    StreamEvent,
    TokenLogprob,
    ToolCallSpec,
    Usage,
)


@dataclass
class ResponseContext:
    """What every object of one response shares."""

    endpoint: str  # "completions" | "chat.completions"
    job_id: str
    model: str
    created: int
    n: int = 1  # choices in all: n per prompt, times the prompts
    choices_per_prompt: int = 1
    echo_texts: list[str] | None = None  # `echo`: each prompt's text
    include_usage: bool = False
    tool_calls: ToolCallSpec | None = None  # chat: read tool calls out of the text

    @property
    def is_chat(self) -> bool:
        return self.endpoint == "chat.completions"

    def echo_for(self, index: int) -> str:
        """The echoed prompt in front of choice `index` ('' without echo)."""
        return self.echo_texts[index // self.choices_per_prompt] if self.echo_texts else ""


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(lp: Any) -> dict[str, Any]:
        return {"token": lp.token, "logprob": lp.logprob, "bytes": lp.bytes}

    return {
        "content": [{**entry(lp), "top_logprobs": [entry(t) for t in lp.top]} for lp in logprobs]
    }


def _completion_logprobs(logprobs: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
    offsets = []
    for lp in logprobs:
        offsets.append(text_offset)
        text_offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t.token: t.logprob for t in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def format_logprobs(
    ctx: ResponseContext, logprobs: list[TokenLogprob] | None, text_offset: int = 0
) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    if ctx.is_chat:
        return _chat_logprobs(logprobs)
    return _completion_logprobs(logprobs, text_offset)


def build_response(ctx: ResponseContext, choices: list[ChoiceResult], usage: Usage) -> dict:
    """The non-streaming `chat.completion` or `text_completion` object."""
    out = []
    for choice in sorted(choices, key=lambda c: c.index):
        echo = ctx.echo_for(choice.index)
        item: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason}
        item["logprobs"] = format_logprobs(ctx, choice.logprobs, len(echo))
        if ctx.is_chat:
            item["message"] = chat_message(ctx, choice.index, choice.text)
            if "tool_calls" in item["message"] and choice.finish_reason == "stop":
                item["finish_reason"] = "tool_calls"
        else:
            item["text"] = echo + choice.text
        out.append(item)
    return {
        "id": ctx.job_id,
        "object": "chat.completion" if ctx.is_chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": out,
        "usage": usage_dict(usage),
    }


def tool_parser(ctx: ResponseContext, index: int) -> ToolCallParser | None:
    return ToolCallParser(ctx.tool_calls, ctx.job_id, index) if ctx.tool_calls else None


def chat_message(ctx: ResponseContext, index: int, text: str) -> dict[str, Any]:
    """The assistant message of one choice, tool calls read out when the request had tools."""
    parser = tool_parser(ctx, index)
    if parser is None:
        return {"role": "assistant", "content": text}
    return merge_deltas(parser.feed(text) + parser.finish())


def build_chunk(
    ctx: ResponseContext,
    index: int,
    text: str | None = None,
    logprobs: dict[str, Any] | None = None,
    finish_reason: str | None = None,
    role: str | None = None,
    delta: dict[str, Any] | None = None,
) -> dict:
    """One streaming chunk carrying one choice's piece (chat: `text` or a whole `delta`)."""
    choice: dict[str, Any] = {"index": index}
    if ctx.is_chat:
        delta = dict(delta or {})
        if role:
            delta["role"] = role
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    chunk: dict[str, Any] = {
        "id": ctx.job_id,
        "object": "chat.completion.chunk" if ctx.is_chat else "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [choice],
    }
    if ctx.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(ctx: ResponseContext, usage: Usage) -> dict:
    chunk = build_chunk(ctx, 0)
    chunk["choices"] = []
    chunk["usage"] = usage_dict(usage)
    return chunk


def sse_data(obj: dict | str) -> str:
    text = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {text}\n\n"


@dataclass
class Accumulator:
    """Collects a job's events into choices (non-streaming responses)."""

    choices: dict[int, ChoiceResult] = field(default_factory=dict)
    done: DoneEvent | None = None
    error: ErrorEvent | None = None

    def add(self, event: StreamEvent) -> None:
        if isinstance(event, RestartEvent):
            self.choices.clear()  # a new attempt regenerates everything
        elif isinstance(event, DeltaEvent):
            choice = self.choices.setdefault(
                event.index,
                ChoiceResult(index=event.index, text="", token_ids=[], finish_reason=""),
            )
            if event.pos is not None and event.pos < len(choice.token_ids):
                return  # written twice (a retried publish): already have it
            choice.text += event.text
            choice.token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + event.logprobs
        elif isinstance(event, DoneEvent):
            self.done = event
        elif isinstance(event, ErrorEvent):
            self.error = event

    def result(self, n: int) -> list[ChoiceResult]:
        assert self.done is not None
        reasons = {end.index: end.finish_reason for end in self.done.choices}
        for index in range(n):
            self.choices.setdefault(
                index, ChoiceResult(index=index, text="", token_ids=[], finish_reason="")
            )
        for choice in self.choices.values():
            choice.finish_reason = reasons.get(choice.index, "stop")
        return list(self.choices.values())

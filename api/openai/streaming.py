"""Events -> OpenAI stream chunks, de-duplicating what a restarted attempt sends again.

Attempts are deterministic (the API always fixes the seed), so after a `restart` the first
tokens of each choice repeat what the client already has; they are compared by token id and
skipped. If they differ, the stream cannot continue consistently and ends with an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from api.openai.formatting import (
    ResponseContext,
    build_chunk,
    format_logprobs,
    tool_parser,
    usage_chunk,
)
from api.openai.tool_calls import ToolCallParser
from shared.contracts import DeltaEvent, DoneEvent, ErrorEvent, RestartEvent, StreamEvent


class StreamInconsistent(Exception):
    """A restarted attempt produced tokens that differ from what was already sent."""


@dataclass
class StreamTranslator:
    ctx: ResponseContext
    sent_ids: dict[int, list[int]] = field(default_factory=dict)
    parsers: dict[int, ToolCallParser | None] = field(default_factory=dict)
    text_offset: dict[int, int] = field(default_factory=dict)
    replay_pos: dict[int, int] = field(default_factory=dict)
    attempt_tokens: dict[int, int] = field(default_factory=dict)  # this attempt's, per choice
    started: bool = False
    done: DoneEvent | None = None
    error: ErrorEvent | None = None

    @property
    def is_terminal(self) -> bool:
        return self.done is not None or self.error is not None

    def start(self) -> list[dict]:
        """Opening chunks: the assistant role (chat) or the echoed prompt (completions)."""
        if self.started:
            return []
        self.started = True
        for index in range(self.ctx.n):
            self.text_offset[index] = len(self.ctx.echo_for(index))
        if self.ctx.is_chat:
            return [build_chunk(self.ctx, i, text="", role="assistant") for i in range(self.ctx.n)]
        echoes = [(i, self.ctx.echo_for(i)) for i in range(self.ctx.n)]
        return [build_chunk(self.ctx, i, text=echo) for i, echo in echoes if echo]

    def on_event(self, event: StreamEvent) -> list[dict]:
        """Chunks to send for one event; raises StreamInconsistent."""
        if isinstance(event, RestartEvent):
            self.replay_pos = {index: 0 for index, ids in self.sent_ids.items() if ids}
            self.attempt_tokens = {}
            return []
        if isinstance(event, DeltaEvent):
            return self._delta(event)
        if isinstance(event, DoneEvent):
            self.done = event
            return self._finish(event)
        if isinstance(event, ErrorEvent):
            self.error = event
        return []

    def _delta(self, event: DeltaEvent) -> list[dict]:
        seen = self.attempt_tokens.get(event.index, 0)
        if event.pos is not None and event.pos < seen:
            return []  # written twice (a retried publish): already handled
        self.attempt_tokens[event.index] = seen + len(event.token_ids)
        sent = self.sent_ids.setdefault(event.index, [])
        if self._is_replay(event, sent):
            return []
        sent.extend(event.token_ids)
        offset = self.text_offset.get(event.index, 0)
        self.text_offset[event.index] = offset + len(event.text)
        logprobs = format_logprobs(self.ctx, event.logprobs, offset)
        parser = self._parser(event.index)
        if parser is None:
            return [build_chunk(self.ctx, event.index, text=event.text, logprobs=logprobs)]
        deltas = parser.feed(event.text)
        chunks = [build_chunk(self.ctx, event.index, delta=delta) for delta in deltas]
        if logprobs is not None:  # the tokens' logprobs ride on the step's last chunk
            chunks = chunks or [build_chunk(self.ctx, event.index, delta={})]
            chunks[-1]["choices"][0]["logprobs"] = logprobs
        return chunks

    def _parser(self, index: int) -> ToolCallParser | None:
        if index not in self.parsers:
            self.parsers[index] = tool_parser(self.ctx, index)
        return self.parsers[index]

    def _is_replay(self, event: DeltaEvent, sent: list[int]) -> bool:
        """True for a delta that repeats already-sent tokens after a restart."""
        pos = self.replay_pos.get(event.index)
        if pos is None:
            return False
        end = pos + len(event.token_ids)
        # A delta straddling the end of what was sent cannot be split: its text is not per token.
        if end > len(sent) or sent[pos:end] != event.token_ids:
            raise StreamInconsistent(
                f"restarted attempt diverged from the tokens already sent (choice {event.index})"
            )
        if end == len(sent):
            del self.replay_pos[event.index]
        else:
            self.replay_pos[event.index] = end
        return True

    def _finish(self, event: DoneEvent) -> list[dict]:
        chunks = []
        for end in sorted(event.choices, key=lambda c: c.index):
            chunks.extend(self._finish_choice(end.index, end.finish_reason))
        if self.ctx.include_usage:
            chunks.append(usage_chunk(self.ctx, event.usage))
        return chunks

    def _finish_choice(self, index: int, reason: str) -> list[dict]:
        """What the tool-call parser still holds, then the choice's finish chunk."""
        if not self.ctx.is_chat:
            return [build_chunk(self.ctx, index, finish_reason=reason)]
        parser = self._parser(index)
        deltas = parser.finish() if parser else []
        chunks = [build_chunk(self.ctx, index, delta=delta) for delta in deltas]
        if parser is not None and parser.has_calls and reason == "stop":
            reason = "tool_calls"
        return chunks + [build_chunk(self.ctx, index, delta={}, finish_reason=reason)]

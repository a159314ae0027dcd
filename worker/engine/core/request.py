"""A request's state inside the engine (plain Python; the scheduler never sees tensors)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from worker.engine.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}


@dataclass
class Request:
    """One sequence. `n > 1` is fanned out by the engine into n Requests sharing a prompt.

    `num_computed_tokens` counts tokens whose KV is in the cache; each step the scheduler
    gives a request `min(num_tokens - num_computed_tokens, budget)` new tokens, which covers
    chunked prefill, prefix-cache hits, decode and recompute after preemption alike.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    # Batch lines ("batch") run after interactive requests and are preempted first.
    lane: str = "interactive"
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    # The engine's GrammarMatcher for a constrained request; the core only passes it along.
    grammar: Any = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole list."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

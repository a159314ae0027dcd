"""What a worker accumulates for one running job, and how engine outputs become events."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from shared.contracts import (
    ChoiceEnd,
    ChoiceResult,
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    JobPayload,
    JobResult,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from shared.tokenizer import Tokenizer
from worker.engine.core.outputs import SampledToken
from worker.engine.engine import SequenceOutput


@dataclass
class ChoiceState:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


def new_engine_request_id(job_id: str) -> str:
    """The engine's id for one attempt of a job: the job id and a fresh suffix.

    Outputs reach the event loop after the step that made them; an attempt aborted on this
    worker may still have some in flight when the next attempt of the same job starts here.
    With one id per attempt they are recognised as stale and dropped (`job_for`), never
    folded into the new attempt's text.
    """
    return f"{job_id}~{secrets.token_hex(4)}"


def job_for(jobs: dict[str, JobState], engine_request_id: str) -> JobState | None:
    """The running attempt an engine output or rejection belongs to (None: a stale one)."""
    job = jobs.get(engine_request_id.rsplit("~", 1)[0])
    return job if job is not None and job.engine_request_id == engine_request_id else None


# How an attempt ends on this worker; each becomes a final JobStatus (`WorkerService`).
Outcome = Literal["completed", "cancelled", "timeout", "rejected"]


@dataclass
class JobState:
    """A job between `started` and its final event. `outcome` resolves when it ends."""

    payload: JobPayload
    attempt: int
    prompt_token_ids: list[int]  # every prompt's, in order (usage counts them all)
    outcome: asyncio.Future[Outcome]
    choices: list[ChoiceState]
    timings: Timings
    cached_tokens: int = 0
    last_token_at: float | None = None
    error: ErrorEvent | None = None
    record_json: str | None = None  # the in-progress record, put back if Redis loses it
    engine_request_id: str = ""  # this attempt's id in the engine (`new_engine_request_id`)

    @classmethod
    def create(
        cls,
        payload: JobPayload,
        attempt: int,
        prompt_token_ids: list[int],
        loop: asyncio.AbstractEventLoop,
        picked_at: float | None = None,
        engine_request_id: str = "",
    ) -> JobState:
        timings = Timings(queued_at=payload.created, started_at=time.time(), picked_at=picked_at)
        choices = [ChoiceState() for _ in range(payload.num_choices)]
        state = cls(payload, attempt, prompt_token_ids, loop.create_future(), choices, timings)
        state.engine_request_id = engine_request_id or new_engine_request_id(payload.id)
        return state

    @property
    def is_finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)

    def apply(self, output: SequenceOutput, tokenizer: Tokenizer) -> DeltaEvent:
        """Fold one sequence output into the job and return the delta event for it."""
        choice = self.choices[output.index]
        pos = len(choice.token_ids)
        choice.text += output.new_text
        choice.token_ids.extend(output.new_token_ids)
        logprobs = None
        if output.new_logprobs is not None:
            logprobs = [to_token_logprob(s, tokenizer) for s in output.new_logprobs]
            choice.logprobs = (choice.logprobs or []) + logprobs
        choice.finish_reason = output.finish_reason or choice.finish_reason
        self.cached_tokens = max(self.cached_tokens, output.num_cached_tokens)
        now = time.time()
        if self.timings.first_token_at is None:
            self.timings.first_token_at = now
            if output.first_scheduled_time is not None:  # the engine's clock is monotonic
                ago = time.monotonic() - output.first_scheduled_time
                self.timings.scheduled_at = now - max(ago, 0.0)
        self.last_token_at = now
        return DeltaEvent(
            index=output.index,
            text=output.new_text,
            token_ids=output.new_token_ids,
            logprobs=logprobs,
            pos=pos,
        )

    def usage(self) -> Usage:
        completion = sum(len(c.token_ids) for c in self.choices)
        prompt = len(self.prompt_token_ids)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            cached_tokens=self.cached_tokens,
        )

    def done_event(self) -> DoneEvent:
        self.timings.finished_at = time.time()
        ends = [
            ChoiceEnd(index=i, finish_reason=c.finish_reason or "abort")
            for i, c in enumerate(self.choices)
        ]
        return DoneEvent(choices=ends, usage=self.usage(), timings=self.timings)

    def result(self) -> JobResult:
        choices = [
            ChoiceResult(
                index=i,
                text=c.text,
                token_ids=c.token_ids,
                finish_reason=c.finish_reason or "abort",
                logprobs=c.logprobs,
            )
            for i, c in enumerate(self.choices)
        ]
        return JobResult(
            prompt_token_ids=self.prompt_token_ids,
            choices=choices,
            usage=self.usage(),
            timings=self.timings,
        )


def to_token_logprob(sampled: SampledToken, tokenizer: Tokenizer) -> TokenLogprob:
    top = [
        TopLogprob(
            token_id=t.token_id,
            token=tokenizer.token_text(t.token_id),
            logprob=t.logprob,
            bytes=tokenizer.token_bytes(t.token_id),
        )
        for t in sampled.top or []
    ]
    return TokenLogprob(
        token_id=sampled.token_id,
        token=tokenizer.token_text(sampled.token_id),
        logprob=sampled.logprob if sampled.logprob is not None else 0.0,
        bytes=tokenizer.token_bytes(sampled.token_id),
        top=top,
    )

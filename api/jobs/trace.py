"""The API's spans for one request: the request itself, its enqueue, and the relay of its
events to the client. With tracing off each method returns at once (no span exists)."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext

from opentelemetry.trace import Span, SpanKind

from shared import tracing
from shared.contracts import DoneEvent, ErrorEvent, JobPayload


class RequestTrace:
    """`ladle.request` (receive -> response end) with `api.enqueue` and `api.jobs.relay` under it;
    the worker's spans join the same trace through the payload's traceparent."""

    def __init__(self, route: str, payload: JobPayload, start: float) -> None:
        """Open the request span (from `start`, when the request arrived) and carry its
        context in the job's payload."""
        self.root: Span | None = None
        self.relay: Span | None = None
        if not tracing.enabled():
            return
        attributes = {
            "http.route": route,
            "ladle.job_id": payload.id,
            "ladle.request_id": payload.request_id or "",
            "gen_ai.request.model": payload.model,
        }
        self.root = tracing.start_span(
            f"POST {route}", None, attributes, start=start, kind=SpanKind.SERVER
        )
        payload.traceparent = tracing.traceparent(self.root)

    def enqueue(self) -> AbstractContextManager[Span | None]:
        if self.root is None:
            return nullcontext()
        return tracing.span("api.enqueue", self.root)

    def relay_started(self) -> None:
        """The first event arrived: from here on the API relays the job's events."""
        if self.root is not None and self.relay is None:
            self.relay = tracing.start_span("api.relay", self.root)

    def finish(self, done: DoneEvent | None = None, error: ErrorEvent | str | None = None) -> None:
        """End the relay and the request (once; later calls do nothing)."""
        if self.root is None:
            return
        now = time.time()
        attributes = {}
        if done is not None:
            attributes = {
                "gen_ai.usage.input_tokens": done.usage.prompt_tokens,
                "gen_ai.usage.output_tokens": done.usage.completion_tokens,
                "gen_ai.response.finish_reasons": [c.finish_reason for c in done.choices],
            }
        message = error.message if isinstance(error, ErrorEvent) else error
        tracing.end_span(self.relay, end=now, error=message)
        tracing.end_span(self.root, end=now, error=message, attributes=attributes)
        self.root = self.relay = None

"""One OpenAI request end to end: validate, enqueue, wait for the first event before headers,
then answer with a JSON object or an SSE stream; cancel the job if the client goes away."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from api.errors import APIError, error_body
from api.jobs.relay import Subscription
from api.jobs.trace import RequestTrace
from api.openai.admission import allowed_priorities, prepare_job, response_context
from api.openai.formatting import Accumulator, ResponseContext, build_response, sse_data
from api.openai.protocol import URL_TO_ENDPOINT, OpenAIRequest
from api.openai.streaming import StreamInconsistent, StreamTranslator
from api.services import Services
from shared.contracts import POOLING_ENDPOINTS, DoneEvent, ErrorEvent, StreamEvent
from shared.logging import job_id_var

log = logging.getLogger(__name__)
T = TypeVar("T")
_CONTENT_EVENTS = frozenset({"delta", "done", "error"})


class ClientDisconnected(Exception):
    pass


async def complete(
    request: Request, services: Services, body: OpenAIRequest, api_key_id: str | None
) -> Response:
    """Serve `/v1/completions` or `/v1/chat/completions`."""
    settings = services.settings
    received = time.time()
    payload = await prepare_job(
        services,
        body,
        api_key_id=api_key_id,
        deadline_s=settings.request_timeout_s,
        priority_range=allowed_priorities(request),
    )
    trace = RequestTrace(request.url.path, payload, start=received)
    job_id_var.set(payload.id)
    deadline = time.monotonic() + settings.request_timeout_s
    url = next(u for u, e in URL_TO_ENDPOINT.items() if e == payload.endpoint)
    ctx = await response_context(services, payload, body.include_usage())
    sub = services.relay.subscribe(payload.id)
    handed_over = False
    try:
        with trace.enqueue():
            await services.jobs.submit(payload, url, getattr(request.state, "quota", None))
        served = _serving(services, payload.model)
        first = await _race(
            request, _first_content(sub, settings.first_event_timeout_s, served), deadline
        )
        trace.relay_started()
        if isinstance(first[-1], ErrorEvent):
            raise _job_error(first[-1], payload.id)
        answer = _StartedJob(services, sub, ctx, first, deadline, trace)
        if body.stream:
            handed_over = True
            headers = {"X-Job-Id": payload.id}
            return StreamingResponse(_sse(answer), media_type="text/event-stream", headers=headers)
        return await _json_response(request, answer)
    except TimeoutError as exc:
        services.jobs.cancel_soon(payload.id)
        raise APIError(504, "The request timed out", code="timeout") from exc
    except ClientDisconnected:
        log.info("client disconnected; cancelling job")
        services.jobs.cancel_soon(payload.id)
        return Response(status_code=499)
    except asyncio.CancelledError:
        if not services.relay.closing:  # at shutdown the job goes on; fetch it by id
            services.jobs.cancel_soon(payload.id)
        raise
    finally:
        if not handed_over:
            services.relay.unsubscribe(sub)
            trace.finish(error="the request ended without a result")


@dataclass
class _StartedJob:
    """What answering a request needs once its job's first events are in."""

    services: Services
    sub: Subscription
    ctx: ResponseContext
    first: list[StreamEvent]
    deadline: float
    trace: RequestTrace


async def _json_response(request: Request, answer: _StartedJob) -> JSONResponse:
    """A non-streamed answer: every event of the job, folded into one response object."""
    acc, ctx = Accumulator(), answer.ctx
    for event in answer.first:
        acc.add(event)
    await _race(request, _collect(answer.sub, acc), answer.deadline)
    if acc.error is not None:
        raise _job_error(acc.error, ctx.job_id)
    assert acc.done is not None
    observe_done(answer.services, acc.done, answer.ctx.endpoint)
    answer.trace.finish(acc.done)
    result = build_response(ctx, acc.result(ctx.n), acc.done.usage)
    return JSONResponse(result, headers={"X-Job-Id": ctx.job_id})


def _job_error(event: ErrorEvent, job_id: str) -> APIError:
    """The job's error as a response that still names the job (it may live on: 503s)."""
    error = APIError.from_event(event)
    error.headers["X-Job-Id"] = job_id
    return error


async def _first_content(
    sub: Subscription, first_event_timeout_s: float, served: Callable[[], Awaitable[bool]]
) -> list[StreamEvent]:
    """Events up to the first delta/done/error (`started`/`restart` come before it).

    A job still queued after `first_event_timeout_s` fails only where no live worker serves
    its model: behind a long queue (64 RAG prompts on one worker) it waits its turn, up to
    the request's own deadline."""
    events: list[StreamEvent] = []
    while not events:
        try:
            events.append((await sub.next(first_event_timeout_s))[1])
        except TimeoutError:
            if not await served():
                raise
    while events[-1].type not in _CONTENT_EVENTS:
        events.append((await sub.next(None))[1])
    return events


def _serving(services: Services, model: str) -> Callable[[], Awaitable[bool]]:
    """Whether a live worker that takes new jobs serves `model` now."""

    async def served() -> bool:
        return model in await services.workers.models()

    return served


async def _collect(sub: Subscription, acc: Accumulator) -> None:
    while acc.done is None and acc.error is None:
        _, event = await sub.next(None)
        acc.add(event)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _race(request: Request, work: Awaitable[T], deadline: float) -> T:
    """`work`, unless the client disconnects (ClientDisconnected) or time runs out."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        timeout = max(0.0, deadline - time.monotonic())
        done, _ = await asyncio.wait(
            {task, watch}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        watch.cancel()
        task.cancel()
    if task in done:
        return task.result()
    if watch in done:
        raise ClientDisconnected
    raise TimeoutError


def observe_done(services: Services, done: DoneEvent, endpoint: str) -> None:
    metrics, t = services.metrics, done.timings
    metrics.prompt_tokens.labels(endpoint=endpoint).inc(done.usage.prompt_tokens)
    metrics.generation_tokens.inc(done.usage.completion_tokens)
    if t.queued_at and t.started_at:
        metrics.queue_time.observe(max(0.0, t.started_at - t.queued_at))
        metrics.lane_wait.labels(lane="interactive").observe(max(0.0, t.started_at - t.queued_at))
    if t.queued_at and t.first_token_at and endpoint not in POOLING_ENDPOINTS:
        metrics.time_to_first_token.observe(max(0.0, t.first_token_at - t.queued_at))
    if t.queued_at and t.finished_at:
        metrics.e2e_latency.observe(max(0.0, t.finished_at - t.queued_at))


async def _sse(answer: _StartedJob) -> AsyncIterator[str]:
    """The SSE body; runs after the headers went out. Cancels the job unless it ended."""
    services, sub, deadline = answer.services, answer.sub, answer.deadline
    translator = StreamTranslator(answer.ctx)
    try:
        for chunk in translator.start():
            yield sse_data(chunk)
        pending = list(answer.first)
        while not translator.is_terminal:
            event = pending.pop(0) if pending else await _next_event(sub, deadline)
            for chunk in translator.on_event(event):
                yield sse_data(chunk)
        if translator.error is not None:
            yield sse_data(APIError.from_event(translator.error).body())
        elif translator.done is not None:
            observe_done(services, translator.done, answer.ctx.endpoint)
        yield sse_data("[DONE]")
    except (TimeoutError, StreamInconsistent) as exc:
        status = 504 if isinstance(exc, TimeoutError) else 500
        message = "The request timed out" if status == 504 else str(exc)
        yield sse_data(error_body(message, "timeout_error" if status == 504 else "server_error"))
        yield sse_data("[DONE]")
    finally:
        services.relay.unsubscribe(sub)
        answer.trace.finish(translator.done, translator.error or _unfinished(translator))
        if not translator.is_terminal and not services.relay.closing:
            services.jobs.cancel_soon(answer.ctx.job_id)


def _unfinished(translator: StreamTranslator) -> str | None:
    return None if translator.is_terminal else "the stream ended before the job did"


async def _next_event(sub: Subscription, deadline: float) -> StreamEvent:
    _, event = await sub.next(max(0.0, deadline - time.monotonic()))
    return event

"""OpenTelemetry traces that follow a job across processes (API -> Redis -> worker -> API).

Off unless an OTLP endpoint is configured (`LLM_OTEL_ENDPOINT`, or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT`): then no SDK is imported, no provider is set up, and every
function here returns at its first line, so a request pays one attribute test per call site.
On, spans go to the endpoint over OTLP/HTTP through a batching processor (export happens on
the processor's thread, not the request's).

The trace context crosses Redis as a W3C `traceparent` string in the job payload. Spans whose
phases another component already timestamps (queue wait, engine queue, prefill, decode) are
recorded afterwards from those timestamps (`record_span`), so nothing is added to the
engine's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACES_PATH = "/v1/traces"
Attributes = Mapping[str, Any]


class _State:
    tracer: Tracer | None = None  # None: tracing is off
    provider: Any = None


def enabled() -> bool:
    return _State.tracer is not None


def otlp_traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL for a base endpoint (`http://host:4318`), as the standard
    OTEL_EXPORTER_OTLP_ENDPOINT means it; a URL that already ends in /v1/traces is kept."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(_TRACES_PATH) else endpoint + _TRACES_PATH


def configure(endpoint: str | None, service_name: str, instance_id: str | None = None) -> bool:
    """Export spans to `endpoint` over OTLP/HTTP; with no endpoint, leave tracing off."""
    if not endpoint:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_traces_url(endpoint)))
    _install(processor, service_name, instance_id)
    log.info("traces exported to %s", otlp_traces_url(endpoint))
    return True


def use_exporter(exporter: Any, service_name: str = "ladle-test") -> None:
    """Send every span to `exporter` as it ends (tests: an InMemorySpanExporter)."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    _install(SimpleSpanProcessor(exporter), service_name, None)


def _install(processor: Any, service_name: str, instance_id: str | None) -> None:
    # Our own provider rather than OTel's global one, which can be set once per process.
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    attributes = {"service.name": service_name}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(processor)
    shutdown()
    _State.provider, _State.tracer = provider, provider.get_tracer("ladle")


def shutdown() -> None:
    """Flush what is buffered and turn tracing off."""
    if _State.provider is not None:
        _State.provider.shutdown()
    _State.provider = _State.tracer = None


def _context(parent: Span | str | None) -> Any:
    if parent is None or isinstance(parent, str):
        return _PROPAGATOR.extract({"traceparent": parent} if parent else {})
    return trace.set_span_in_context(parent)


def _ns(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1e9)


def start_span(
    name: str,
    parent: Span | str | None = None,
    attributes: Attributes | None = None,
    *,
    start: float | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span | None:
    """A span under `parent` (a span or a traceparent string); None when tracing is off."""
    tracer = _State.tracer
    if tracer is None:
        return None
    return tracer.start_span(
        name, _context(parent), kind=kind, attributes=attributes, start_time=_ns(start)
    )


def end_span(
    span: Span | None,
    *,
    end: float | None = None,
    error: str | None = None,
    attributes: Attributes | None = None,
) -> None:
    """End a span (no-op for None), marking it failed with `error` when given."""
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=_ns(end))


def record_span(
    name: str,
    parent: Span | str | None,
    start: float | None,
    end: float | None,
    attributes: Attributes | None = None,
) -> Span | None:
    """A span for a phase already over, from its timestamps (skipped if one is missing)."""
    if _State.tracer is None or start is None or end is None:
        return None
    span = start_span(name, parent, attributes, start=start)
    end_span(span, end=max(start, end))
    return span


@contextmanager
def span(
    name: str, parent: Span | str | None, attributes: Attributes | None = None
) -> Iterator[Span | None]:
    """A span around a block; an exception marks it failed and goes on."""
    current = start_span(name, parent, attributes)
    try:
        yield current
    except BaseException as exc:
        end_span(current, error=repr(exc))
        raise
    end_span(current)


def traceparent(span_: Span | None) -> str | None:
    """The W3C traceparent header value for `span_` (None when tracing is off)."""
    if span_ is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, trace.set_span_in_context(span_))
    return carrier.get("traceparent")

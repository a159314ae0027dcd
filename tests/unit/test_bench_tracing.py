"""loadtest.bench_tracing's pieces: the on/off order, and its OTLP sink receiving the real
exporter's spans (so `shared.tracing.configure` is tested against OTLP/HTTP too)."""

from __future__ import annotations

import time

from loadtest.bench_tracing import OtlpSink, micro_cost, schedule
from shared import tracing


def test_schedule_alternates_which_side_goes_first() -> None:
    assert schedule(1) == [False, True]
    assert schedule(3) == [False, True, True, False, False, True]


def test_configured_tracing_exports_spans_over_otlp_http() -> None:
    sink = OtlpSink()
    try:
        assert tracing.configure(sink.url, "ladle-test")
        with tracing.span("unit", None, {"ladle.job_id": "job-1"}) as span:
            assert span is not None and tracing.traceparent(span).startswith("00-")
        tracing.shutdown()  # flushes the batching processor
        deadline = time.monotonic() + 30
        while sink.num_exports == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sink.num_exports >= 1 and sink.num_bytes > 0
        assert not tracing.enabled()
    finally:
        tracing.shutdown()
        sink.close()


def test_micro_cost_runs_the_real_span_code_and_exports_it() -> None:
    sink = OtlpSink()
    try:
        assert micro_cost(sink, 3) > 0
        assert sink.num_exports >= 1 and not tracing.enabled()
    finally:
        sink.close()

"""Pure pieces of the API (no Redis): request validation, stream translation, formats."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import ValidationError

from api.jobs.relay import parse_entry_id
from api.openai.formatting import Accumulator, ResponseContext, build_response
from api.openai.prompting import check_context, sampling_spec
from api.openai.protocol import ChatCompletionRequest, CompletionRequest
from api.openai.streaming import StreamInconsistent, StreamTranslator
from shared.contracts import ChoiceEnd, DeltaEvent, DoneEvent, RestartEvent, Usage
from shared.logging import JsonFormatter, request_id_var
from shared.metrics import ApiMetrics, WorkerMetrics, render
from shared.queue import deserialize_job, serialize_job


def _delta(index: int, token: int, text: str) -> DeltaEvent:
    return DeltaEvent(index=index, text=text, token_ids=[token])


def test_prompt_shapes() -> None:
    assert CompletionRequest(prompt=["one"]).prompt_list() == ["one"]
    assert CompletionRequest(prompt=[[5, 6]]).prompt_list() == [[5, 6]]
    assert CompletionRequest(prompt=[5, 6]).prompt_list() == [[5, 6]]
    assert CompletionRequest(prompt=[[7], [8, 9]]).prompt_list() == [[7], [8, 9]]
    for bad in (["a", ""], [[1], []], [[1, -2]], ["x"] * 65, ["a", [7]]):
        with pytest.raises(ValidationError):
            CompletionRequest(prompt=bad)
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", stop=["a"] * 17)


def test_chat_fields_map_to_sampling() -> None:
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        max_tokens=5,
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=3,
        stop="END",
        logit_bias={"7": -100},
        seed=11,
    )
    spec = sampling_spec(req, 9)
    assert (spec.max_tokens, spec.logprobs, spec.stop, spec.logit_bias, spec.seed) == (
        9,
        3,
        ["END"],
        {7: -100.0},
        11,
    )
    assert sampling_spec(ChatCompletionRequest(messages=[{"role": "user"}]), 4).logprobs is None
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)


def test_check_context() -> None:
    assert check_context(10, None, 64, "prompt") == 54
    assert check_context(10, 54, 64, "prompt") == 54
    with pytest.raises(Exception, match="maximum context length is 64"):
        check_context(64, None, 64, "messages")


def test_restart_replay_skips_matching_tokens() -> None:
    tr = StreamTranslator(ResponseContext("completions", "job-1", "m", 0, n=2))
    sent = [tr.on_event(e) for e in (_delta(0, 5, "a"), _delta(1, 9, "z"), _delta(0, 6, "b"))]
    assert [c[0]["choices"][0]["text"] for c in sent] == ["a", "z", "b"]
    assert tr.on_event(RestartEvent(attempt=2, reason="lost")) == []
    assert tr.on_event(_delta(0, 5, "a")) == []
    assert tr.on_event(_delta(1, 9, "z")) == []
    assert tr.on_event(_delta(0, 6, "b")) == []
    assert tr.on_event(_delta(0, 7, "c"))[0]["choices"][0]["text"] == "c"
    assert tr.on_event(_delta(1, 8, "y"))[0]["choices"][0]["text"] == "y"
    tr.on_event(RestartEvent(attempt=3, reason="lost"))
    with pytest.raises(StreamInconsistent):
        tr.on_event(_delta(0, 99, "q"))


def test_accumulator_restart_and_build() -> None:
    acc = Accumulator()
    for event in (
        _delta(0, 5, "a"),
        RestartEvent(attempt=2, reason="x"),
        _delta(0, 5, "b"),
        DoneEvent(
            choices=[ChoiceEnd(index=0, finish_reason="length")],
            usage=Usage(prompt_tokens=3, completion_tokens=1),
        ),
    ):
        acc.add(event)
    ctx = ResponseContext("completions", "job-1", "m", 0, echo_texts=["P:"])
    body = build_response(ctx, acc.result(1), acc.done.usage)
    assert body["choices"][0]["text"] == "P:b" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["total_tokens"] == 4


def test_entry_ids() -> None:
    assert parse_entry_id("1700-3") == (1700, 3) and parse_entry_id("0") == (0, 0)
    for bad in ("", "x-1", "1-x", "-1"):
        with pytest.raises(ValueError):
            parse_entry_id(bad)


def test_queue_serializer_is_json() -> None:
    job = {"t": 1, "f": "run_completion", "a": ["{}"], "k": {}, "et": 5}
    data = serialize_job(job)
    assert json.loads(data) == job and deserialize_job(data) == job
    assert json.loads(serialize_job({"r": ValueError("bad")}))["r"] == "ValueError: bad"


def test_json_log_line() -> None:
    token = request_id_var.set("req-1")
    try:
        record = logging.LogRecord("api", logging.INFO, "", 0, "hello %s", ("x",), None)
        record.status = 200
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)
    assert line["msg"] == "hello x" and line["request_id"] == "req-1" and line["status"] == 200


def test_metric_groups() -> None:
    api, worker = ApiMetrics(), WorkerMetrics()
    api_text = render(api.registry)[0].decode()
    worker_text = render(worker.registry)[0].decode()
    assert "llm_requests_total" in api_text and "llm_kv_cache_usage_bytes" not in api_text
    for name in (
        "llm_kv_cache_usage_bytes",
        "llm_batch_size",
        "llm_num_preemptions_total",
        "llm_prefix_cache_hits_total",
        "llm_spec_decode_acceptance_rate",
        "llm_tokens_per_decode_step",
        "llm_inter_token_latency_seconds",
    ):
        assert name in worker_text


def test_an_exception_becomes_one_error_event_keeping_param_and_code() -> None:
    from shared.contracts import error_event
    from shared.errors import InvalidRequestError

    refused = InvalidRequestError("too long", param="messages", code="context_length_exceeded")
    event = error_event(refused, 500)  # a request error is a 400 whatever the caller's default
    assert (event.status, event.error_type, event.param, event.code) == (
        400,
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    )
    crash = error_event(RuntimeError("boom"), code="worker_lost")
    assert (crash.status, crash.error_type, crash.message, crash.code) == (
        500,
        "server_error",
        "boom",
        "worker_lost",
    )

"""Bad input, one table: every case is a 4xx with OpenAI's error body, and no job is queued.

The fake worker is registered (max_model_len 64, model `test-model`, limits n <= 4 and
logit_bias <= 5 entries from api_harness.make_settings) but never runs a job.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from tests.unit.api_harness import harness

pytestmark = pytest.mark.redis

CMPL, CHAT, JOBS = "/v1/completions", "/v1/chat/completions", "/v1/jobs"
PROMPT = {"model": "test-model", "prompt": "Hello"}
MSGS = {"model": "test-model", "messages": [{"role": "user", "content": "Hi"}]}
INVALID = "invalid_request_error"


@dataclass
class Case:
    """One request and the error it must produce (param/code None: the body says null)."""

    id: str
    path: str
    body: object = None  # JSON-encoded unless `raw` is given
    status: int = 400
    param: str | None = None
    code: str | None = "invalid_parameter"
    error_type: str = INVALID
    raw: bytes | None = None
    method: str = "POST"
    headers: dict[str, str] = field(default_factory=dict)


def _cmpl(**extra: object) -> dict:
    return {**PROMPT, **extra}


def _chat(**extra: object) -> dict:
    return {**MSGS, **extra}


def _job(body: object, url: str = CMPL) -> dict:
    return {"url": url, "body": body}


CTX = "context_length_exceeded"
CASES = [
    # Not JSON, not an object, not UTF-8.
    Case("malformed-json", CMPL, raw=b'{"prompt": "x",', code="invalid_json"),
    Case("empty-body", CHAT, raw=b"", code="invalid_json"),
    Case("json-array", CMPL, [PROMPT], param=None),
    Case("json-string", CHAT, "hello", param=None),
    Case("invalid-utf8", CMPL, raw=b'{"prompt": "\xff\xfe"}', code="invalid_json"),
    Case(
        "invalid-utf8-chat",
        CHAT,
        raw=b'{"messages": [{"role": "user", "content": "\xc3"}]}',
        code="invalid_json",
    ),
    Case("malformed-json-job", JOBS, raw=b"{nope", code="invalid_json"),
    # Wrong types.
    Case("temperature-string", CMPL, _cmpl(temperature="hot"), param="temperature"),
    Case("prompt-number", CMPL, _cmpl(prompt=5), param="prompt"),
    Case("prompt-dict", CMPL, _cmpl(prompt={"a": 1}), param="prompt"),
    Case("messages-string", CHAT, _chat(messages="hi"), param="messages"),
    Case(
        "message-role-unknown",
        CHAT,
        _chat(messages=[{"role": "robot", "content": "x"}]),
        param="messages.0.role",
    ),
    Case("message-not-object", CHAT, _chat(messages=["hi"]), param="messages.0"),
    Case("n-float", CMPL, _cmpl(n=1.5), param="n"),
    Case("stream-list", CHAT, _chat(stream=[1]), param="stream"),
    Case("stop-number", CMPL, _cmpl(stop=7), param="stop"),
    Case("logit-bias-list", CMPL, _cmpl(logit_bias=[1, 2]), param="logit_bias"),
    Case("max-tokens-string", CMPL, _cmpl(max_tokens="many"), param="max_tokens"),
    Case(
        "stream-options-string",
        CHAT,
        _chat(stream=True, stream_options="yes"),
        param="stream_options",
    ),
    Case("job-body-not-object", JOBS, {"url": CMPL, "body": "x"}, param="body"),
    Case("detokenize-tokens-strings", "/detokenize", {"tokens": ["a"]}, param="tokens.0"),
    # Missing fields.
    Case("no-prompt", CMPL, {"model": "test-model"}, param="prompt"),
    Case("no-messages", CHAT, {"model": "test-model"}, param="messages"),
    Case("message-no-role", CHAT, _chat(messages=[{"content": "x"}]), param="messages.0.role"),
    Case("job-no-url", JOBS, {"body": PROMPT}, param="url"),
    Case("job-no-body", JOBS, {"url": CMPL}, param="body"),
    Case("job-inner-no-prompt", JOBS, _job({"model": "test-model"}), param="prompt"),
    Case("tokenize-nothing", "/tokenize", {"model": "test-model"}, param=None),
    # Empty prompt or messages.
    Case("prompt-empty-string", CMPL, _cmpl(prompt=""), param="prompt"),
    Case("prompt-empty-list", CMPL, _cmpl(prompt=[]), param="prompt"),
    Case("prompt-batch-too-long", CMPL, _cmpl(prompt=["a"] * 65), param="prompt"),
    Case("prompt-batch-empty-item", CMPL, _cmpl(prompt=["a", ""]), param="prompt"),
    Case("prompt-negative-token", CMPL, _cmpl(prompt=[5, -1]), param="prompt"),
    Case("messages-empty", CHAT, _chat(messages=[]), param="messages"),
    Case("job-inner-messages-empty", JOBS, _job(_chat(messages=[]), CHAT), param="messages"),
    # Longer than the context (64 tokens), max_tokens zero or beyond the context.
    Case("prompt-too-long", CMPL, _cmpl(prompt="a" * 70), param="prompt", code=CTX),
    Case("token-prompt-too-long", CMPL, _cmpl(prompt=[5] * 64), param="prompt", code=CTX),
    Case(
        "messages-too-long",
        CHAT,
        _chat(messages=[{"role": "user", "content": "a" * 70}]),
        param="messages",
        code=CTX,
    ),
    Case("max-tokens-zero", CMPL, _cmpl(max_tokens=0), param="max_tokens"),
    Case("max-tokens-negative", CHAT, _chat(max_tokens=-3), param="max_tokens"),
    Case(
        "max-completion-tokens-zero",
        CHAT,
        _chat(max_completion_tokens=0),
        param="max_completion_tokens",
    ),
    Case("max-tokens-beyond-context", CMPL, _cmpl(max_tokens=64), param="prompt", code=CTX),
    Case(
        "max-completion-tokens-beyond-context",
        CHAT,
        _chat(max_completion_tokens=10_000),
        param="messages",
        code=CTX,
    ),
    Case(
        "job-max-tokens-beyond-context",
        JOBS,
        _job(_cmpl(max_tokens=1000)),
        param="prompt",
        code=CTX,
    ),
    # Sampling ranges.
    Case("temperature-negative", CMPL, _cmpl(temperature=-0.1), param="temperature"),
    Case("temperature-above-2", CHAT, _chat(temperature=2.01), param="temperature"),
    Case("top-p-zero", CMPL, _cmpl(top_p=0), param="top_p"),
    Case("top-p-negative", CHAT, _chat(top_p=-0.5), param="top_p"),
    Case("top-p-above-1", CMPL, _cmpl(top_p=1.01), param="top_p"),
    Case("n-zero", CMPL, _cmpl(n=0), param="n"),
    Case("n-above-max", CHAT, _chat(n=5), param="n", code="invalid_n"),
    Case(
        "logit-bias-too-many",
        CMPL,
        _cmpl(logit_bias={str(i): 1 for i in range(6)}),
        param="logit_bias",
        code="invalid_logit_bias",
    ),
    Case("logit-bias-value", CHAT, _chat(logit_bias={"5": 101}), param="logit_bias"),
    Case("logit-bias-key", CMPL, _cmpl(logit_bias={"abc": 1}), param="logit_bias"),
    Case("logprobs-above-20", CMPL, _cmpl(logprobs=21), param="logprobs"),
    Case("top-logprobs-without-logprobs", CHAT, _chat(top_logprobs=2), param=None),
    Case("penalty-out-of-range", CMPL, _cmpl(presence_penalty=2.5), param="presence_penalty"),
    Case("stop-too-many", CMPL, _cmpl(stop=[str(i) for i in range(17)]), param="stop"),
    Case("stop-empty", CHAT, _chat(stop=[""]), param="stop"),
    Case("top-k-below-minus-1", CMPL, _cmpl(top_k=-2), param="top_k"),
    Case("seed-too-big", CMPL, _cmpl(seed=2**64), param="seed"),
    Case("suffix", CMPL, _cmpl(suffix="x"), param="suffix", code="unsupported_parameter"),
    Case("job-inner-temperature", JOBS, _job(_cmpl(temperature=3)), param="temperature"),
    Case("job-unknown-url", JOBS, {"url": "/v1/embeddings", "body": PROMPT}, param="url"),
    # Unknown model.
    Case(
        "unknown-model",
        CMPL,
        _cmpl(model="gpt-9"),
        status=404,
        param="model",
        code="model_not_found",
    ),
    Case(
        "unknown-model-chat",
        CHAT,
        _chat(model="gpt-9"),
        status=404,
        param="model",
        code="model_not_found",
    ),
    Case(
        "unknown-model-job",
        JOBS,
        _job(_cmpl(model="gpt-9")),
        status=404,
        param="model",
        code="model_not_found",
    ),
    Case(
        "unknown-model-tokenize",
        "/tokenize",
        {"model": "gpt-9", "prompt": "x"},
        status=404,
        param="model",
        code="model_not_found",
    ),
    # Unknown job ids, malformed Last-Event-ID.
    Case(
        "get-unknown-job",
        "/v1/jobs/job-doesnotexist",
        method="GET",
        status=404,
        param="job_id",
        code="job_not_found",
        error_type="not_found_error",
    ),
    Case(
        "delete-unknown-job",
        "/v1/jobs/job-doesnotexist",
        method="DELETE",
        status=404,
        param="job_id",
        code="job_not_found",
        error_type="not_found_error",
    ),
    Case(
        "events-unknown-job",
        "/v1/jobs/job-doesnotexist/events",
        method="GET",
        status=404,
        param="job_id",
        code="job_not_found",
        error_type="not_found_error",
    ),
    Case(
        "events-malformed-last-event-id",
        "/v1/jobs/job-doesnotexist/events",
        method="GET",
        headers={"Last-Event-ID": "x-1"},
        param="Last-Event-ID",
        code=None,
    ),
    Case(
        "events-last-event-id-junk",
        "/v1/jobs/job-doesnotexist/events",
        method="GET",
        headers={"Last-Event-ID": "12-34-56"},
        param="Last-Event-ID",
        code=None,
    ),
    # Unknown route, wrong method.
    Case(
        "unknown-route", "/v1/audio/speech", {}, status=404, code=None, error_type="not_found_error"
    ),
    Case("wrong-method", CMPL, method="GET", status=405, code=None),
    # Embeddings: the body's own checks come before the model's (400 naming the field).
    Case("embed-no-input", "/v1/embeddings", {"model": "m"}, param="input"),
    Case("embed-empty", "/v1/embeddings", {"model": "m", "input": []}, param="input"),
    Case(
        "embed-format",
        "/v1/embeddings",
        {"input": "a", "encoding_format": "x"},
        param="encoding_format",
    ),
    Case("embed-dims", "/v1/embeddings", {"input": "a", "dimensions": 0}, param="dimensions"),
    Case(
        "embed-truncate",
        "/v1/embeddings",
        {"input": "a", "truncate_prompt_tokens": 0},
        param="truncate_prompt_tokens",
    ),
    Case("rerank-no-docs", "/v1/rerank", {"query": "q", "documents": []}, param="documents"),
    Case(
        "rerank-top-n", "/v1/rerank", {"query": "q", "documents": ["d"], "top_n": 0}, param="top_n"
    ),
    Case("score-no-text", "/v1/score", {"text_1": "a"}, param="text_2"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
async def test_bad_input_is_4xx_with_openai_error(case: Case) -> None:
    async with harness(start_worker=False) as h:
        content = case.raw
        if content is None and case.body is not None:
            content = json.dumps(case.body).encode()
        headers = {"Content-Type": "application/json", **case.headers}
        r = await h.client.request(case.method, case.path, content=content, headers=headers)
        assert r.status_code == case.status, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        assert (error["type"], error["param"], error["code"]) == (
            case.error_type,
            case.param,
            case.code,
        ), error
        assert await h.redis.zcard(h.keys.queue("test-model")) == 0  # nothing was enqueued


async def test_body_over_the_size_limit_is_413() -> None:
    async with harness(start_worker=False, max_request_body_bytes=2048) as h:
        r = await h.client.post(CMPL, json=_cmpl(prompt="x" * 4000))
        assert r.status_code == 413
        assert r.json()["error"] == {
            "message": "Request body larger than 2048 bytes",
            "type": INVALID,
            "param": None,
            "code": "request_too_large",
        }

        async def chunks():
            for _ in range(10):
                yield b"x" * 500

        r = await h.client.post(CMPL, content=chunks())  # chunked: no Content-Length
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await h.client.post(CMPL, content=b"{}", headers={"Content-Length": "abc"})
        assert r.status_code == 413
        assert await h.redis.zcard(h.keys.queue("test-model")) == 0


async def test_malformed_last_event_id_on_a_real_job() -> None:
    async with harness() as h:
        job_id = (await h.client.post(JOBS, json=_job(PROMPT))).json()["id"]
        for bad in ("x-1", "1-", "-1", "1-2-3", "9" * 30 + "-0", "1.5-0"):
            r = await h.client.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "Last-Event-ID"

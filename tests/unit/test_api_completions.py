"""Completions and chat completions through the API with a scripted worker."""

from __future__ import annotations

import pytest

from tests.unit.api_harness import harness, sse_payloads
from tests.unit.fake_worker import TOKENIZER, delta, error_script

pytestmark = pytest.mark.redis


async def test_completion_non_stream() -> None:
    async with harness() as h:
        r = await h.client.post(
            "/v1/completions", json={"model": "test-model", "prompt": "Hello", "seed": 7}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "text_completion"
        assert body["id"].startswith("job-") and r.headers["x-job-id"] == body["id"]
        assert body["choices"] == [
            {"index": 0, "finish_reason": "stop", "logprobs": None, "text": "Hi 0!"}
        ]
        assert body["usage"]["completion_tokens"] == 5
        payload = h.worker.payloads[0]
        assert payload.prompt == "Hello" and payload.endpoint == "completions"
        assert payload.prompt_token_ids == TOKENIZER.encode("Hello")
        assert payload.sampling.seed == 7 and payload.sampling.max_tokens == 16


async def test_chat_non_stream_n2_and_random_seed() -> None:
    async with harness() as h:
        messages = [
            {"role": "system", "content": "Be brief"},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ]
        r = await h.client.post(
            "/v1/chat/completions", json={"model": "test-model", "messages": messages, "n": 2}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "chat.completion"
        assert [c["message"] for c in body["choices"]] == [
            {"role": "assistant", "content": "Hi 0!"},
            {"role": "assistant", "content": "Hi 1!"},
        ]
        payload = h.worker.payloads[0]
        assert payload.messages == [
            {"role": "system", "content": "Be brief"},
            {"role": "user", "content": "Hi"},
        ]
        assert payload.sampling.seed is not None
        assert payload.prompt_token_ids == TOKENIZER.apply_chat_template(payload.messages)
        prompt_len = len(payload.prompt_token_ids)
        assert payload.sampling.max_tokens == 64 - prompt_len  # default: what fits


async def test_chat_stream_with_usage() -> None:
    async with harness() as h:
        r = await h.client.post(
            "/v1/chat/completions",
            json={
                "model": "test-model",
                "messages": [{"role": "user", "content": "Hi"}],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = sse_payloads(r.text)
        assert chunks[-1] == "[DONE]"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
        assert text == "Hi 0!"
        assert chunks[-3]["choices"][0]["finish_reason"] == "stop"
        usage = chunks[-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
        assert all(c["usage"] is None for c in chunks[:-2])


async def test_completion_stream_n2_logprobs() -> None:
    async with harness() as h:
        r = await h.client.post(
            "/v1/completions",
            json={"model": "test-model", "prompt": "Hello", "stream": True, "n": 2, "logprobs": 2},
        )
        chunks = sse_payloads(r.text)
        assert chunks[-1] == "[DONE]" and "usage" not in chunks[0]
        by_index: dict[int, str] = {0: "", 1: ""}
        for c in chunks[:-1]:
            by_index[c["choices"][0]["index"]] += c["choices"][0]["text"]
        assert by_index == {0: "Hi 0!", 1: "Hi 1!"}
        first = chunks[0]["choices"][0]["logprobs"]
        assert first == {
            "tokens": ["H"],
            "token_logprobs": [-0.5],
            "top_logprobs": [{"H": -0.5, "I": -1.5}],
            "text_offset": [0],
        }
        second_0 = [c for c in chunks[:-1] if c["choices"][0]["index"] == 0][1]
        assert second_0["choices"][0]["logprobs"]["text_offset"] == [1]


async def test_chat_logprobs_non_stream() -> None:
    async with harness() as h:
        r = await h.client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Hi"}],
                "logprobs": True,
                "top_logprobs": 1,
            },
        )
        content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 5
        assert content[0] == {
            "token": "H",
            "logprob": -0.5,
            "bytes": None,
            "top_logprobs": [{"token": "H", "logprob": -0.5, "bytes": None}],
        }
        assert h.worker.payloads[0].sampling.logprobs == 1


async def test_echo_completion() -> None:
    async with harness() as h:
        r = await h.client.post("/v1/completions", json={"prompt": [72, 0 + 108], "echo": True})
        # token ids 72, 108 decode to bytes 69 ('E'), 105 ('i') in the fake tokenizer
        assert r.json()["choices"][0]["text"] == "Ei" + "Hi 0!"


async def test_worker_error_becomes_http_status() -> None:
    script = error_script(
        400, "This model's maximum context length is 64 tokens.", "context_length_exceeded"
    )
    async with harness(script) as h:
        for stream in (False, True):
            r = await h.client.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert r.status_code == 400
            assert r.json()["error"]["code"] == "context_length_exceeded"


async def test_context_length_checked_by_api() -> None:
    async with harness() as h:
        r = await h.client.post("/v1/completions", json={"prompt": "a" * 70})
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert error["message"].startswith("This model's maximum context length is 64 tokens.")
        r = await h.client.post("/v1/completions", json={"prompt": "a" * 40, "max_tokens": 30})
        assert r.status_code == 400
        assert (
            "you requested 71 tokens (41 in the prompt, 30 in the completion)"
            in (r.json()["error"]["message"])
        )
        r = await h.client.post(
            "/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert h.worker.payloads == []


def _restart_script(diverge: bool):
    from shared.contracts import ChoiceEnd, DoneEvent, RestartEvent, StartedEvent, Usage

    def script(payload):
        again = [delta(0, "H"), delta(0, "X" if diverge else "i"), delta(0, "!")]
        return [
            StartedEvent(worker_id="w", prompt_tokens=2),
            delta(0, "H"),
            delta(0, "i"),
            RestartEvent(attempt=2, reason="worker lost"),
            StartedEvent(worker_id="w2", prompt_tokens=2, attempt=2),
            *again,
            DoneEvent(
                choices=[ChoiceEnd(index=0, finish_reason="length")],
                usage=Usage(prompt_tokens=2, completion_tokens=3, total_tokens=5),
            ),
        ]

    return script


async def test_restart_is_deduplicated() -> None:
    async with harness(_restart_script(diverge=False)) as h:
        r = await h.client.post("/v1/completions", json={"prompt": "x"})
        assert r.json()["choices"][0]["text"] == "Hi!"
        r = await h.client.post("/v1/completions", json={"prompt": "x", "stream": True})
        chunks = sse_payloads(r.text)
        assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["H", "i", "!", ""]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_restart_divergence_ends_stream_with_error() -> None:
    async with harness(_restart_script(diverge=True)) as h:
        r = await h.client.post("/v1/completions", json={"prompt": "x", "stream": True})
        chunks = sse_payloads(r.text)
        assert [c["choices"][0]["text"] for c in chunks[:2]] == ["H", "i"]
        assert "diverged" in chunks[2]["error"]["message"] and chunks[3] == "[DONE]"


async def _call_and_disconnect(app, body: dict, after_s: float, started=lambda: True) -> list[dict]:
    """Drive the ASGI app directly; the client disconnects `after_s` after `started()`."""
    import asyncio
    import json

    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        while not started():  # a loaded machine may take a while to enqueue the job
            await asyncio.sleep(0.01)
        await asyncio.sleep(after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("t", 1),
        "server": ("test", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


@pytest.mark.parametrize("stream", [False, True])
async def test_disconnect_cancels_job(stream: bool) -> None:
    import asyncio

    async with harness() as h:
        h.worker.step_s = 0.05
        await _call_and_disconnect(
            h.app,
            {"prompt": "x", "stream": stream},
            after_s=0.15,
            started=lambda: bool(h.worker.payloads),
        )
        job_id = h.worker.payloads[0].id
        for _ in range(100):
            raw = await h.redis.get(h.keys.job(job_id))
            if b'"status":"cancelled"' in raw:
                break
            await asyncio.sleep(0.02)
        assert await h.redis.exists(h.keys.cancelled(job_id))
        assert b'"status":"cancelled"' in raw


@pytest.mark.parametrize(("asked", "ran"), [(-100_000, -5), (0, 0), (7, 7), (10**9, 20)])
async def test_priority_is_clamped_to_the_configured_range(asked: int, ran: int) -> None:
    async with harness(priority_min=-5, priority_max=20) as h:
        body = {"model": "test-model", "prompt": "Hello", "priority": asked}
        assert (await h.client.post("/v1/completions", json=body)).status_code == 200
        payload = h.worker.payloads[0]
        assert (payload.priority, payload.lane) == (ran, "interactive")


async def test_each_key_clamps_priority_to_its_own_range(tmp_path) -> None:  # noqa: ANN001
    keys = tmp_path / "keys.toml"
    keys.write_text(
        "priority_min = 0\npriority_max = 50\n"
        '[keys.ops]\nkey = "sk-ops-0123456789"\npriority_min = -100\n'
        '[keys.bulk]\nkey = "sk-bulk-0123456789"\npriority_min = 40\npriority_max = 60\n'
    )
    async with harness(api_keys_file=str(keys)) as h:
        for key in ("sk-ops-0123456789", "sk-bulk-0123456789"):
            for asked in (-1000, 1000):
                body = {"model": "test-model", "prompt": "Hello", "priority": asked}
                headers = {"Authorization": f"Bearer {key}"}
                response = await h.client.post("/v1/completions", json=body, headers=headers)
                assert response.status_code == 200
        ran = [payload.priority for payload in h.worker.payloads]
        assert ran == [-100, 50, 40, 60]  # ops: its own min, the file's max; bulk: its own

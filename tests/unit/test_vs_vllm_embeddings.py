"""The embedding comparison's load generator (loadtest/vs_vllm_embeddings.py) on a fake
server: every input is sent once in requests of the batch size, and a short answer fails."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadtest.vs_vllm_embeddings import timed_level


def _run(handler, texts: list[str], batch: int, clients: int) -> tuple[float, float]:  # noqa: ANN001
    async def go() -> tuple[float, float]:
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(transport=transport, base_url="http://fake/v1") as http:
            return await timed_level(http, "m", texts, batch, clients)

    return asyncio.run(go())


def test_every_input_is_sent_once_in_batches() -> None:
    sent: list[list[str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        assert request.url.path == "/v1/embeddings" and body["model"] == "m"
        sent.append(body["input"])
        return httpx.Response(200, json={"data": [{"embedding": [1.0]} for _ in body["input"]]})

    texts = [f"t{i}" for i in range(70)]
    rate, median_ms = _run(handler, texts, 32, 2)
    assert sent[0] == texts[:32]  # the warm-up
    assert sorted(t for chunk in sent[1:] for t in chunk) == sorted(texts)
    assert sorted(len(chunk) for chunk in sent[1:]) == [6, 32, 32]
    assert rate > 0 and median_ms >= 0


def test_missing_vectors_or_an_error_status_fail() -> None:
    def short(request: httpx.Request) -> httpx.Response:
        inputs = json.loads(request.content)["input"]
        return httpx.Response(200, json={"data": [{"embedding": [1.0]}] * (len(inputs) - 1)})

    def refused(request: httpx.Request) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": "no"}})

    with pytest.raises(RuntimeError, match="0 vectors, 1 inputs"):
        _run(short, ["a", "b", "c"], 1, 1)
    with pytest.raises(RuntimeError, match="400"):
        _run(refused, ["a"], 1, 1)

"""A client that reads an SSE stream very slowly (a tiny socket buffer, then nothing) holds
no worker resource: the job completes and its KV blocks are freed while the client reads
nothing; the API keeps at most LLM_STREAM_BUFFER_EVENTS of its events in memory (the rest
wait in Redis). When the client reads on, it gets the whole stream, equal to the
job's stored result."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.faults import PROMPT, model_id, wait_records
from tests.support.harness import Service, start_service

# Chat chunks with 20 top logprobs are ~2 KB: 8 x 480 of them (~8 MB) outgrow what the
# kernel buffers (tcp_wmem max 4 MB), so the API must feel the slow client.
BOUND, N, MAX_TOKENS = 16, 8, 480


@pytest.fixture(scope="module")
def svc(tiny_service_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = start_service(
        tiny_service_model, tmp_path_factory.mktemp("logs"), stream_buffer_events=BOUND
    )
    yield service
    service.stop()


def _open_stalled_stream(svc: Service, payload: dict) -> socket.socket:
    """Send the request on a socket with a 2 KiB receive buffer, and read nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect(("127.0.0.1", svc.port))
    data = json.dumps(payload).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def _relay_gauges(http: httpx.Client) -> dict[str, float]:
    found = {}
    for line in http.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in ("llm_relay_buffered_events", "llm_relay_paused_readers"):
            found[name] = float(value)
    return found


def _read_all(sock: socket.socket) -> dict[int, str]:
    """Read the rest of the stream; the text of each choice."""
    sock.settimeout(60)
    raw = b""
    while b"data: [DONE]" not in raw:
        chunk = sock.recv(65536)
        assert chunk, "the stream ended without [DONE]"
        raw += chunk
    texts: dict[int, str] = {}
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text = choice["delta"].get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + text
    return texts


def test_a_stalled_client_costs_no_worker_and_bounded_api_memory(
    svc: Service,
) -> None:
    payload = {
        "model": model_id(svc),
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": N,
        "logprobs": True,
        "top_logprobs": 20,
    }
    sock = _open_stalled_stream(svc, payload)
    try:
        done = wait_records(
            svc, lambda rs: any(r["status"] == "completed" for r in rs.values()), timeout=120
        )
        with svc.client() as http:
            svc.wait_kv_free(http, timeout=10)  # the worker is done with it
            gauges = _relay_gauges(http)
            deadline = time.monotonic() + 30
            while gauges.get("llm_relay_paused_readers") != 1 and time.monotonic() < deadline:
                time.sleep(0.1)
                gauges = _relay_gauges(http)
        assert gauges["llm_relay_paused_readers"] == 1  # the client is behind and paused
        assert 0 < gauges["llm_relay_buffered_events"] <= BOUND
        assert len(done) == 1
        texts = _read_all(sock)
    finally:
        sock.close()
    job = next(iter(done.values()))
    with svc.client() as http:
        stored = http.get(f"/v1/jobs/{job['id']}").json()
    assert stored["usage"]["completion_tokens"] == N * MAX_TOKENS
    expected = stored["response"]["choices"][0]["message"]["content"]
    assert texts == {index: expected for index in range(N)}  # all of it, once

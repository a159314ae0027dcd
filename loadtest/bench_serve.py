"""Streaming serving benchmark: an OpenAI-compatible server, the engine in-process, or both.

    python -m loadtest.bench_serve --base-url http://127.0.0.1:8000/v1   # any server
    python -m loadtest.bench_serve --engine                              # engine, no service
    python -m loadtest.bench_serve --compare --json out.json             # service vs engine

Every request is a prompt of random token ids sent to /v1/completions with stream=true,
greedy, `ignore_eos` and a fixed max_tokens, so every system generates exactly the same
amount. Metrics: TTFT, inter-token latency (gaps between streamed chunks), TPOT, end-to-end
latency and output tokens/s per concurrency level (see loadtest/workload.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.workload import (
    LevelResult,
    RequestRecord,
    Workload,
    format_ratios,
    format_table,
    run_levels,
)

# ---- an OpenAI-compatible server over HTTP ---------------------------------------------------


class OpenAIStreamClient:
    """Streams /v1/completions; falls back to text prompts if token-id prompts are refused."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        workload: Workload,
        api_key: str | None = None,
        tokenizer_dir: str | None = None,
        timeout_s: float = 600.0,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.workload = workload
        self.tokenizer_dir = tokenizer_dir
        self._decode: Any = None  # token ids -> text, only after a token-id prompt is refused
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self.http = httpx.AsyncClient(
            headers=headers,
            limits=limits,
            transport=transport,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    async def prepare(self) -> None:
        """Pick the model, then warm up (switching to text prompts if ids are refused)."""
        if self.model is None:
            response = await self.http.get(f"{self.base_url}/models")
            response.raise_for_status()
            self.model = response.json()["data"][0]["id"]
        probe = self.workload.prompts(-1)[0]
        record = await self.send(probe, max_tokens=4)
        if record.error and record.error.startswith("HTTP 4"):
            self._decode = _load_decoder(self.tokenizer_dir)
            record = await self.send(probe, max_tokens=4)
        if not record.ok:
            raise RuntimeError(f"warm-up request failed: {record.error}")

    def body(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": self._decode(prompt) if self._decode else prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    async def send(self, prompt: list[int], max_tokens: int | None = None) -> RequestRecord:
        body = self.body(prompt, max_tokens or self.workload.output_len)
        record = RequestRecord(start=time.perf_counter())
        try:
            async with self.http.stream(
                "POST", f"{self.base_url}/completions", json=body
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    record.error = f"HTTP {response.status_code}: {text[:300]}"
                else:
                    await _consume_sse(response, record)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        record.end = time.perf_counter()
        return record


async def _consume_sse(response: httpx.Response, record: RequestRecord) -> None:
    """Record the arrival of every token-carrying chunk and the usage's completion tokens."""
    num_chunks, usage_tokens = 0, None
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            record.error = f"stream error: {chunk['error']}"
            return
        if chunk.get("usage"):
            usage_tokens = chunk["usage"].get("completion_tokens")
        if any(_carries_token(c) for c in chunk.get("choices") or []):
            record.chunk_times.append(time.perf_counter())
            num_chunks += 1
    record.output_tokens = usage_tokens if usage_tokens is not None else num_chunks


def _carries_token(choice: dict[str, Any]) -> bool:
    """A chunk with text, or without a finish_reason (a token that decoded to nothing yet)."""
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def _load_decoder(tokenizer_dir: str | None) -> Any:
    from transformers import AutoTokenizer

    path = tokenizer_dir or str(default_hf_dir())
    tokenizer = AutoTokenizer.from_pretrained(path)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def default_hf_dir() -> Path:
    """The converted HF directory of the default model (created by the first engine start)."""
    from shared.model_files import DEFAULT_MODEL_NAME, converted_dir, resolve_model

    return converted_dir(resolve_model(DEFAULT_MODEL_NAME))


# ---- the engine in this process ------------------------------------------------------------


class EngineDriver:
    """The engine on its EngineThread, bridged to asyncio the way the worker does it."""

    def __init__(self, built: BuiltEngine, workload: Workload) -> None:
        from worker.engine_thread import EngineThread

        engine = self.engine = built.engine
        self.workload = workload
        self.loop = asyncio.get_running_loop()
        self._queues: dict[str, asyncio.Queue[Any]] = {}
        self.thread = EngineThread(engine, self._on_outputs, self._on_reject, host=built.host)
        self.thread.start()

    def close(self) -> None:
        self.thread.stop()

    async def prepare(self) -> None:
        record = await self.send(self.workload.prompts(-1)[0], max_tokens=4)
        if not record.ok:
            raise RuntimeError(f"warm-up request failed: {record.error}")

    async def send(self, prompt: list[int], max_tokens: int | None = None) -> RequestRecord:
        from worker.engine.core.sampling_params import SamplingParams

        record = RequestRecord(start=time.perf_counter())
        request_id = uuid.uuid4().hex
        params = SamplingParams(
            temperature=0.0, ignore_eos=True, max_tokens=max_tokens or self.workload.output_len
        )
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[request_id] = queue
        try:
            self.thread.add(self.engine.prepare(request_id, prompt, params))
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    record.error = f"rejected: {item}"
                    break
                record.chunk_times.append(time.perf_counter())
                record.output_tokens += len(item.new_token_ids)
                if item.finished:
                    break
        except ValueError as exc:
            record.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._queues.pop(request_id, None)
        record.end = time.perf_counter()
        return record

    def _on_outputs(self, outputs: list[Any]) -> None:
        self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _on_reject(self, request_id: str, exc: Exception) -> None:
        self.loop.call_soon_threadsafe(self._dispatch_one, request_id, exc)

    def _dispatch(self, outputs: list[Any]) -> None:
        for output in outputs:
            self._dispatch_one(output.request_id, output)

    def _dispatch_one(self, request_id: str, item: Any) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(item)


@dataclass
class BuiltEngine:
    """An engine and the thread it was built on, which must also step it (`EngineHost`)."""

    engine: Any
    host: Any


def build_engine(model: str | None = None) -> BuiltEngine:
    """The engine exactly as a worker builds it from the LLM_* settings, on its own thread."""
    from shared.config import Settings
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine
    from worker.engine_thread import EngineHost

    settings = Settings(**({"model_name": model} if model else {}))
    host = EngineHost()
    return BuiltEngine(host.submit(LLMEngine, EngineConfig.from_settings(settings)).result(), host)


# ---- running a target ----------------------------------------------------------------------


async def bench_http(
    base_url: str,
    model: str | None,
    workload: Workload,
    levels: list[int],
    max_seconds: float,
    api_key: str | None = None,
    tokenizer_dir: str | None = None,
) -> list[LevelResult]:
    client = OpenAIStreamClient(
        base_url, model, workload, api_key, tokenizer_dir, max_connections=max(levels) + 4
    )
    try:
        await client.prepare()
        return await run_levels(client.send, workload, levels, max_seconds)
    finally:
        await client.aclose()


async def bench_engine(
    built: BuiltEngine, workload: Workload, levels: list[int], max_seconds: float
) -> list[LevelResult]:
    driver = EngineDriver(built, workload)
    try:
        await driver.prepare()
        return await run_levels(driver.send, workload, levels, max_seconds)
    finally:
        await asyncio.to_thread(driver.close)


# ---- starting and stopping servers ---------------------------------------------------------


def spare_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Poll `url` until it answers 200; fail early if `proc` exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode} before it was ready; "
                f"log tail:\n{tail(log_path)}"
            )
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s:.0f} s; log tail:\n{tail(log_path)}")


def tail(path: Path, num_lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-num_lines:])
    return "(no log)"


def stop_process(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGINT (a graceful stop for both our launcher and uvicorn), then kill its group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # leftovers: children started in its session
    proc.wait()


@contextlib.contextmanager
def private_redis() -> Iterator[str]:
    """A throwaway redis-server on a spare port (persistence off), else the LLM_REDIS_URL one."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield os.environ.get("LLM_REDIS_URL", "redis://127.0.0.1:6379/0")
        return
    port = spare_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def running_service(
    num_workers: int = 1,
    model: str | None = None,
    ready_timeout_s: float = 600.0,
    extra_env: dict[str, str] | None = None,
    worker_groups: list[str] | None = None,
) -> Iterator[str]:
    """`ladle up` on a spare port with its own Redis and key prefix; yields the /v1 base URL.

    `extra_env` (e.g. {"LLM_QUANTIZATION": "int4"}) is added to the service's environment;
    `worker_groups` ("NAME=MODEL" each) are `--worker` flags, in place of `--workers`.
    """
    port = spare_port()
    log_path = Path(tempfile.gettempdir()) / f"ladle-bench-service-{port}.log"
    with private_redis() as redis_url:
        env = dict(
            os.environ,
            LLM_KEY_PREFIX=f"bench-{uuid.uuid4().hex[:8]}",
            LLM_WORKER_METRICS_PORT="0",
            LLM_LOG_LEVEL=os.environ.get("LLM_LOG_LEVEL", "WARNING"),  # INFO shows thread choices
        )
        env.update(extra_env or {})
        argv = [
            sys.executable,
            "-m",
            "ladle",
            "up",
            "--workers",
            str(num_workers),
            "--port",
            str(port),
            "--redis-url",
            redis_url,
            "--no-start-redis",
        ]
        if model:
            argv += ["--model", model]
        for group in worker_groups or []:
            argv += ["--worker", group]
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            wait_ready(f"http://127.0.0.1:{port}/ready", proc, ready_timeout_s, log_path)
            yield f"http://127.0.0.1:{port}/v1"
        finally:
            stop_process(proc)


# ---- the command line ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--model", help="model id to request (default: first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("LADLE_API_KEY"))
    p.add_argument("--tokenizer", help="HF dir to decode prompts if a server refuses token ids")
    p.add_argument("--num-prompts", type=int, default=64, help="prompts per level (64)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=49152, help="random ids below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--concurrency", default="1,4,16", help="levels, comma-separated")
    p.add_argument("--max-seconds", type=float, default=60.0, help="time limit per level")
    p.add_argument("--engine", action="store_true", help="drive the engine in this process")
    p.add_argument(
        "--compare",
        action="store_true",
        help="start the service, bench it, stop it, then bench the engine",
    )
    p.add_argument("--workers", type=int, default=1, help="workers for --compare (1)")
    p.add_argument("--json", dest="json_out", help="write the results here")
    return p.parse_args(argv)


def workload_from(args: argparse.Namespace) -> Workload:
    return Workload(
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        seed=args.seed,
        vocab_size=args.vocab_size,
    )


def levels_from(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_compare(args: argparse.Namespace, workload: Workload, levels: list[int]) -> dict[str, Any]:
    print(f"service (ladle up --workers {args.workers}):", flush=True)
    with running_service(args.workers) as base_url:
        service = asyncio.run(bench_http(base_url, None, workload, levels, args.max_seconds))
    print("engine in-process:", flush=True)
    engine = build_engine(args.model)
    engine_results = asyncio.run(bench_engine(engine, workload, levels, args.max_seconds))
    print("\n" + format_table("service", service))
    print("\n" + format_table("engine in-process", engine_results))
    print("\n" + format_ratios(service, engine_results))
    return {"service": service, "engine": engine_results}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload, levels = workload_from(args), levels_from(args.concurrency)
    load_before = os.getloadavg()
    if args.compare:
        results = run_compare(args, workload, levels)
    elif args.engine:
        engine = build_engine(args.model)
        workload.vocab_size = min(workload.vocab_size, engine.engine.executor.vocab_size)
        results = {"engine": asyncio.run(bench_engine(engine, workload, levels, args.max_seconds))}
        print("\n" + format_table("engine in-process", results["engine"]))
    else:
        results = {
            "server": asyncio.run(
                bench_http(
                    args.base_url,
                    args.model,
                    workload,
                    levels,
                    args.max_seconds,
                    args.api_key,
                    args.tokenizer,
                )
            )
        }
        print("\n" + format_table(args.base_url, results["server"]))
    print(
        f"\nload average before: {load_before[0]:.2f}, after: {os.getloadavg()[0]:.2f} "
        f"({os.cpu_count()} CPUs)"
    )
    if args.json_out:
        out = {
            "workload": asdict(workload),
            "levels": levels,
            "max_seconds": args.max_seconds,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            **{name: [r.to_dict() for r in rs] for name, rs in results.items()},
        }
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

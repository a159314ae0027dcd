"""The serving benchmark's metrics, its SSE client (against a fake server) and its in-process
engine driver (on a tiny random model)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
import torch

from loadtest.bench_serve import BuiltEngine, EngineDriver, OpenAIStreamClient, bench_engine
from loadtest.workload import (
    Dist,
    RequestRecord,
    Workload,
    format_ratios,
    format_table,
    percentile,
    run_level,
    summarize,
)
from tests.support.engines import add_tiny_tokenizer, make_engine
from tests.support.tiny_models import tiny_model_dir


def test_percentile_interpolates_like_numpy() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile(values, 100) == 5.0
    assert math.isnan(percentile([], 50))


def test_summarize_exact_figures() -> None:
    a = RequestRecord(start=0.0, end=1.0, chunk_times=[0.2, 0.5, 1.0], output_tokens=3)
    b = RequestRecord(start=0.5, end=1.5, chunk_times=[0.6, 0.8, 1.0, 1.5], output_tokens=4)
    failed = RequestRecord(start=0.0, end=0.1, error="HTTP 503: busy")
    result = summarize(4, [a, b, failed], duration_s=2.0)
    assert (result.num_ok, result.num_failed, result.output_tokens) == (2, 1, 7)
    assert result.output_tokens_per_s == 3.5
    assert result.requests_per_s == 1.0
    assert result.ttft_ms.mean == pytest.approx(150.0)  # 200 and 100 ms
    assert result.ttft_ms.median == pytest.approx(150.0)
    # gaps: 300, 500 | 200, 200, 500 ms
    assert result.itl_ms.median == pytest.approx(300.0)
    assert result.itl_ms.mean == pytest.approx(340.0)
    assert result.e2e_ms.mean == pytest.approx(1000.0)
    # TPOT: (1.0 - 0.2) / 2 = 400 ms and (1.0 - 0.1) / 3 = 300 ms
    assert result.tpot_ms.median == pytest.approx(350.0)
    assert result.errors == ["HTTP 503: busy"]
    assert "| 4 | 2 | 1 | 3.5 |" in format_table("x", [result])
    ratios = format_ratios([result], [summarize(4, [a, b], duration_s=1.0)])
    assert "| 4 | 3.5 | 7.0 | 0.50 | +0.00 |" in ratios


def test_empty_distribution_is_nan() -> None:
    assert math.isnan(Dist.of([]).median)


def test_prompts_are_deterministic_and_distinct_per_level() -> None:
    workload = Workload(num_prompts=3, input_len=5, vocab_size=256, seed=7)
    first = workload.prompts(0)
    assert first == workload.prompts(0)
    assert first != workload.prompts(1)
    assert [len(p) for p in first] == [5, 5, 5]
    assert all(64 <= t < 256 for p in first for t in p)


def test_closed_loop_bounds_concurrency_and_count() -> None:
    in_flight, peak = 0, 0

    async def send(prompt: list[int]) -> RequestRecord:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        record = RequestRecord(start=0.0)
        await asyncio.sleep(0.001)
        record.chunk_times, record.end, record.output_tokens = [0.001], 0.002, 1
        in_flight -= 1
        return record

    prompts = [[i] for i in range(10)]
    records, _ = asyncio.run(run_level(send, prompts, concurrency=3, max_seconds=30))
    assert len(records) == 10 and peak == 3
    records, _ = asyncio.run(run_level(send, prompts, concurrency=3, max_seconds=0))
    assert records == []


def _sse(chunks: list[dict]) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def _fake_server(seen: list[dict], refuse_ids: bool) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if refuse_ids and isinstance(body["prompt"], list):
            return httpx.Response(400, json={"error": {"message": "no token ids"}})
        n = body["max_tokens"]
        chunks = [
            {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            for i in range(n - 1)
        ]
        chunks.append({"choices": [{"index": 0, "text": " end", "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": n}})
        return httpx.Response(
            200, content=_sse(chunks), headers={"content-type": "text/event-stream"}
        )

    return httpx.MockTransport(handler)


def test_sse_client_counts_chunks_and_usage() -> None:
    seen: list[dict] = []
    workload = Workload(num_prompts=2, input_len=5, output_len=6, vocab_size=256)

    async def go() -> list[RequestRecord]:
        client = OpenAIStreamClient(
            "http://test/v1", None, workload, transport=_fake_server(seen, refuse_ids=False)
        )
        await client.prepare()
        records = [await client.send(p) for p in workload.prompts(0)]
        await client.aclose()
        return records

    records = asyncio.run(go())
    assert all(r.ok and r.output_tokens == 6 and len(r.chunk_times) == 6 for r in records)
    body = seen[-1]
    assert body["model"] == "fake-model" and body["prompt"] == workload.prompts(0)[1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0


def test_sse_client_falls_back_to_text_prompts(tmp_path: Path) -> None:
    add_tiny_tokenizer(tmp_path)
    seen: list[dict] = []
    workload = Workload(num_prompts=1, input_len=3, output_len=2, vocab_size=256, seed=1)

    async def go() -> RequestRecord:
        client = OpenAIStreamClient(
            "http://test/v1",
            "m",
            workload,
            tokenizer_dir=str(tmp_path),
            transport=_fake_server(seen, refuse_ids=True),
        )
        await client.prepare()
        record = await client.send(workload.prompts(0)[0])
        await client.aclose()
        return record

    record = asyncio.run(go())
    assert record.ok and record.output_tokens == 2
    assert seen[-1]["prompt"] == " ".join(f"w{t}" for t in workload.prompts(0)[0])


def test_engine_driver_on_tiny_model(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model_dir = tiny_model_dir("llama", tmp_path)
    add_tiny_tokenizer(model_dir)
    engine = make_engine(model_dir)
    workload = Workload(num_prompts=5, input_len=8, output_len=5, vocab_size=256)
    results = asyncio.run(bench_engine(BuiltEngine(engine, None), workload, [1, 3], max_seconds=60))
    assert [(r.concurrency, r.num_ok, r.num_failed) for r in results] == [(1, 5, 0), (3, 5, 0)]
    assert [r.output_tokens for r in results] == [25, 25]
    assert all(r.itl_ms.median > 0 and r.output_tokens_per_s > 0 for r in results)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_engine_driver_reports_rejected_prompt(tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama", tmp_path)
    add_tiny_tokenizer(model_dir)
    engine = make_engine(model_dir)
    workload = Workload(output_len=5, vocab_size=256)

    async def go() -> RequestRecord:
        driver = EngineDriver(BuiltEngine(engine, None), workload)
        try:
            return await driver.send([300, 4])  # out of the vocabulary
        finally:
            await asyncio.to_thread(driver.close)

    record = asyncio.run(go())
    assert not record.ok and "prompt token ids must be in [0, 256)" in record.error


def test_vs_vllm_report_and_env(tmp_path: Path) -> None:
    from loadtest.vs_vllm import report_markdown, vllm_env

    a = RequestRecord(start=0.0, end=1.0, chunk_times=[0.2, 0.5, 1.0], output_tokens=3)
    fast, slow = summarize(4, [a], duration_s=1.0), summarize(4, [a], duration_s=2.0)
    meta = {
        "workload": "w",
        "levels": [4],
        "max_seconds": 10.0,
        "vllm_version": "0.32.0",
        "vllm_config": "bf16",
        "ladle_env": {"LLM_QUANTIZATION": "int4"},
        "load_before": 1.0,
        "load_after": 2.0,
    }
    text = report_markdown([fast], [slow], meta)
    assert "| 4 | 3.0 | 1.5 | 0.50 | 400.0 | 400.0 | 200 | 200 | 1.0 | 1.0 |" in text
    assert "{'LLM_QUANTIZATION': 'int4'}" in text
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_text("")
    env = vllm_env(tmp_path, 3, "0-1", preload=True)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert str(tmp_path / "lib" / "libiomp5.so") in env["LD_PRELOAD"]


def test_vs_vllm_ladle_env_flags() -> None:
    from loadtest.vs_vllm import ladle_env

    assert ladle_env(["LLM_QUANTIZATION=int4", "LLM_DECODE_THREADS=2"]) == {
        "LLM_QUANTIZATION": "int4",
        "LLM_DECODE_THREADS": "2",
    }
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        ladle_env(["LLM_QUANTIZATION"])


def test_single_stream_report_ratios_and_bounds() -> None:
    from loadtest.single_stream import report_markdown

    rows = [
        {"engine": "Ladle int4", "decode_tokens_per_s": 30.0, "weight_bytes_per_token": 100e6},
        {"engine": "llama.cpp 0.3", "decode_tokens_per_s": 60.0, "weight_bytes_per_token": 80e6},
    ]
    for row in rows:
        row["memory_bound_tokens_per_s"] = 20e9 / row["weight_bytes_per_token"]
    report = {
        "rows": rows,
        "cpu": {"model_name": "Some CPU", "flags": "avx2 avx512f"},
        "threads": 1,
        "load_before": (1.0, 1.0, 1.0),
        "load_after": (2.0, 1.0, 1.0),
        "read_bandwidth_gbs": 20.0,
        "gemm_bf16": {1: {"tflops": 0.1, "bound_tokens_per_s": 400.0}, 64: {"tflops": 0.3}},
        "prompt_len": 128,
        "tokens": 128,
        "gguf": "m.gguf",
    }
    text = report_markdown(report)
    assert "| Ladle int4 | 100 MB | 30.0 | 200 | 15% | 0.50 |" in text
    assert "| llama.cpp 0.3 | 80 MB | 60.0 | 250 | 24% | 1.00 |" in text
    assert "Some CPU" in text and "`avx2 avx512f`" in text


def test_grid_table_puts_ladle_beside_vllm_and_llama_server() -> None:
    from loadtest.grid import shape_table, workload_for

    def level(concurrency: int, tok_s: float) -> object:
        record = RequestRecord(start=0.0, end=1.0, chunk_times=[0.1, 0.2], output_tokens=2)
        result = summarize(concurrency, [record], 1.0)
        result.output_tokens_per_s = tok_s
        return result

    results = {
        "ladle": {"chat": [level(1, 30.0), level(16, 300.0)]},
        "vllm": {"chat": [level(1, 20.0), level(16, 200.0)]},
        "ladle-4bit": {"chat": [level(1, 60.0)]},
        "llama-server": {"chat": [level(1, 40.0)]},
    }
    lines = shape_table(results, "chat", [1, 16])
    assert lines[-2].startswith("| 1 |") and lines[-2].endswith("| 1.50 | 1.50 |")
    assert lines[-1].startswith("| 16 |") and "300.0 (100 / 100.0) | - | 200.0" in lines[-1]
    assert lines[-1].endswith("| 1.50 | - |")
    rag = workload_for("rag", 16, 49152)
    assert (rag.input_len, rag.output_len, rag.num_prompts) == (2048, 128, 64)
    assert workload_for("chat", 64, 49152).num_prompts == 128
    # no cell starts with another cell's prompts: the prefix caches would serve them
    firsts = {
        tuple(workload_for(shape, c, 49152, seed).prompts(0)[0][:16])
        for shape in ("chat", "rag", "long")
        for c in (1, 16, 64)
        for seed in (0, 1)
    }
    assert len(firsts) == 18

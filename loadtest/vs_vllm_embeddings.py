"""Ladle's `/v1/embeddings` beside vLLM's CPU build on the same embedding model, over HTTP.

    python -m loadtest.vs_vllm_embeddings [--model all-MiniLM-L6-v2] [--dtype float32]
        [--batch-sizes 1,32,256] [--concurrency 1] [--rounds 2] [--venv .cache/vllm-venv]
        [--vllm-url http://127.0.0.1:PORT/v1]

Both servers run at once on the model's sentence-transformers directory (same weights, same
pooling config): `vllm serve DIR --runner pooling --dtype D` (installed as `loadtest.vs_vllm`
does; or the one already serving at `--vllm-url`) and `ladle up --worker NAME=DIR` with its
own Redis. One load generator drives one server at a time: for each batch size B, requests
of B sentences (loadtest/data/english.txt, 4-60 words) from `--concurrency` clients; the two
servers alternate within each round and the best round of each is reported as inputs/s.
Before timing, both embed the same 64 sentences and the cosine between their vectors is
reported. Prints one JSON report (CPU model, load average before and after, versions);
exits 3 with vLLM's error if it cannot serve the model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench_embeddings import cpu_model, sentences
from loadtest.bench_serve import running_service
from loadtest.vs_vllm import (
    VllmUnavailable,
    add_vllm_arguments,
    ensure_vllm,
    serving_vllm,
    vllm_env,
)


async def timed_level(
    http: httpx.AsyncClient, model: str, texts: list[str], batch: int, clients: int
) -> tuple[float, float]:
    """inputs/s and median request latency (ms) for `texts` sent `batch` per request by
    `clients` concurrent loops, after one warm-up request of that shape."""
    chunks = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    latencies: list[float] = []

    async def client() -> None:
        while chunks:
            chunk = chunks.pop()
            started = time.perf_counter()
            vectors = await embed(http, model, chunk)
            latencies.append(time.perf_counter() - started)
            if len(vectors) != len(chunk):
                raise RuntimeError(f"{http.base_url}: {len(vectors)} vectors, {len(chunk)} inputs")

    await embed(http, model, texts[:batch])
    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return len(texts) / (time.perf_counter() - started), statistics.median(latencies) * 1000


async def timed_server(
    base_url: str, model: str, texts: list[str], batch: int, clients: int
) -> tuple[float, float]:
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        return await timed_level(http, model, texts, batch, clients)


async def embed(http: httpx.AsyncClient, model: str, inputs: list[str]) -> list[list[float]]:
    response = await http.post("/embeddings", json={"model": model, "input": inputs})
    if response.status_code != 200:
        raise RuntimeError(f"{http.base_url}: {response.status_code} {response.text[:500]}")
    return [item["embedding"] for item in response.json()["data"]]


async def agreement(servers: dict[str, str], model: str) -> dict[str, float]:
    """Min and mean cosine between the two servers' vectors for the same 64 sentences."""
    import torch
    import torch.nn.functional as F

    texts = sentences(64)
    found = []
    for base_url in servers.values():
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
            found.append(torch.tensor(await embed(http, model, texts), dtype=torch.float64))
    cosines = F.cosine_similarity(found[0], found[1])
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean())}


def measure(servers: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for batch in args.batch_sizes:
        texts = sentences(max(args.inputs, 2 * batch))
        best: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in servers}
        for _ in range(args.rounds):
            for name, base_url in servers.items():
                level = timed_server(base_url, args.served_name, texts, batch, args.concurrency)
                rate, median_ms = asyncio.run(level)
                best[name] = max(best[name], (rate, median_ms))
        row = {"batch": batch, "inputs": len(texts)}
        for name, (rate, median_ms) in best.items():
            row |= {f"{name}_inputs_per_s": round(rate, 1), f"{name}_median_ms": round(median_ms)}
        row["ladle_over_vllm"] = round(best["ladle"][0] / best["vllm"][0], 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


@contextlib.contextmanager
def both_servers(args: argparse.Namespace, model_dir: Path) -> Iterator[dict[str, str]]:
    ladle_env = {"LLM_DTYPE": args.dtype, **dict(p.split("=", 1) for p in args.ladle_env)}
    worker = f"{args.served_name}={model_dir}"
    with (
        vllm_server(args, model_dir) as vllm_url,
        running_service(worker_groups=[worker], extra_env=ladle_env) as ladle_url,
    ):
        yield {"vllm": vllm_url, "ladle": ladle_url}


@contextlib.contextmanager
def vllm_server(args: argparse.Namespace, model_dir: Path) -> Iterator[str]:
    """The running vLLM at `--vllm-url`, else one started here (stopped afterwards)."""
    if args.vllm_url:
        yield args.vllm_url
        return
    venv = Path(args.venv)
    ensure_vllm(venv, args.vllm_version, args.install_timeout)
    options = ["--runner", "pooling", "--dtype", args.dtype, "--served-model-name"]
    options += [args.served_name, *args.vllm_option]
    env = vllm_env(venv, args.kv_space, args.omp_bind, not args.no_preload)
    with serving_vllm(venv, model_dir, options, env, args.ready_timeout) as base_url:
        yield base_url


def run(args: argparse.Namespace) -> dict[str, Any]:
    from shared.model_files import resolve_model

    model_dir = resolve_model(args.model).path
    load_before = os.getloadavg()
    with both_servers(args, model_dir) as servers:
        version = httpx.get(servers["vllm"].removesuffix("/v1") + "/version").json()["version"]
        agree = asyncio.run(agreement(servers, args.served_name))
        print(json.dumps(agree), flush=True)
        rows = measure(servers, args)
    return {
        "command": " ".join(["python", "-m", "loadtest.vs_vllm_embeddings", *sys.argv[1:]]),
        "model": args.model,
        "dtype": args.dtype,
        "concurrency": args.concurrency,
        "cpu": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "vllm_version": version,
        "vllm_settings": "started here" if not args.vllm_url else f"at {args.vllm_url}",
        "ladle_settings": f"ladle up --worker NAME=DIR, LLM_DTYPE={args.dtype} {args.ladle_env}",
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "vllm_vs_ladle": agree,
        "results": rows,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="all-MiniLM-L6-v2", help="a name or an HF/ST directory")
    p.add_argument("--served-name", default="all-MiniLM-L6-v2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch-sizes", default="1,32,256", type=lambda s: list(map(int, s.split(","))))
    p.add_argument("--concurrency", type=int, default=1, help="clients per level (1)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--inputs", type=int, default=256, help="per level, at least 2 batches")
    add_vllm_arguments(p, kv_space=1)
    p.add_argument("--vllm-url", help="a vLLM already serving the model (its /v1 URL)")
    p.add_argument("--vllm-option", action="append", default=[], help="more `vllm serve` flags")
    p.add_argument("--ladle-env", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", dest="json_out", help="write the report here too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = run(args)
    except VllmUnavailable as exc:
        print(f"vLLM unavailable: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

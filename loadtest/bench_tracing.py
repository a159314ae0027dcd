"""Tracing on vs off through the whole service, at one concurrency, in the same run.

    python -m loadtest.bench_tracing                       # c16, 64 prompts, 2 rounds
    python -m loadtest.bench_tracing --rounds 3 --concurrency 16

Each round starts `ladle up` twice (its own Redis each time): once without an OTLP endpoint
(tracing off: no SDK set up), once with LLM_OTEL_ENDPOINT pointing at a sink in this process
that accepts OTLP/HTTP exports and counts them (so the export's cost is in the figure). The
order alternates (off, on, on, off, ...) so drift on a shared machine falls on both sides.
Prints tokens/s, TTFT and ITL per run, the on/off ratio of the means, the spans' bytes
received, load average and the CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from loadtest.bench_serve import bench_http, running_service, spare_port
from loadtest.single_stream import cpu_description
from loadtest.workload import LevelResult, Workload


class OtlpSink:
    """An OTLP/HTTP traces receiver that answers 200 and counts what it got."""

    def __init__(self) -> None:
        self.num_exports = 0
        self.num_bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                sink.num_exports += 1
                sink.num_bytes += len(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", spare_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def run_once(traced: bool, sink: OtlpSink, workload: Workload, args: argparse.Namespace):  # noqa: ANN201
    env = {"LLM_OTEL_ENDPOINT": sink.url} if traced else {"LLM_OTEL_ENDPOINT": ""}
    with running_service(args.workers, extra_env=env) as base_url:
        results = asyncio.run(
            bench_http(base_url, None, workload, [args.concurrency], args.max_seconds)
        )
    return results[0]


def schedule(rounds: int) -> list[bool]:
    """off, on, on, off, off, on, ...: each side first as often as the other."""
    order: list[bool] = []
    for i in range(rounds):
        order += [False, True] if i % 2 == 0 else [True, False]
    return order


def report(runs: list[tuple[bool, LevelResult]], sink: OtlpSink, load: tuple) -> None:
    print("| run | tracing | tok/s | TTFT median ms | ITL median ms | failed |")
    print("|---|---|---|---|---|---|")
    for i, (traced, r) in enumerate(runs, 1):
        print(
            f"| {i} | {'on' if traced else 'off'} | {r.output_tokens_per_s:.1f} | "
            f"{r.ttft_ms.median:.0f} | {r.itl_ms.median:.1f} | {r.num_failed} |"
        )
    on = [r.output_tokens_per_s for t, r in runs if t]
    off = [r.output_tokens_per_s for t, r in runs if not t]
    print(
        f"\ntok/s mean: off {statistics.mean(off):.1f}, on {statistics.mean(on):.1f}, "
        f"on/off {statistics.mean(on) / statistics.mean(off):.3f}"
    )
    print(f"OTLP exports received: {sink.num_exports} ({sink.num_bytes / 1e3:.0f} kB)")
    print(
        f"load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}; "
        f"{os.cpu_count()} CPUs; {cpu_description()['model_name']}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_tracing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs (2)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="limit per run")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = Workload(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    sink, load = OtlpSink(), os.getloadavg()
    runs = []
    try:
        for traced in schedule(args.rounds):
            print(f"run {len(runs) + 1}: tracing {'on' if traced else 'off'}", flush=True)
            runs.append((traced, run_once(traced, sink, workload, args)))
    finally:
        sink.close()
    report(runs, sink, load)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

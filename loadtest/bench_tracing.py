"""Tracing on vs off through the whole service, at one concurrency, in the same run.

    python -m loadtest.bench_tracing                       # c16, 64 prompts, 2 rounds
    python -m loadtest.bench_tracing --rounds 3 --concurrency 16

Each round starts `ladle up` twice (its own Redis each time): once without an OTLP endpoint
(tracing off: no SDK set up), once with LLM_OTEL_ENDPOINT pointing at a sink in this process
that accepts OTLP/HTTP exports and counts them (so the export's cost is in the figure). The
order alternates (off, on, on, off, ...) so drift on a shared machine falls on both sides.
Prints tokens/s, TTFT and ITL per run, the on/off ratio of the means, the spans' bytes
received, load average and the CPU model.

On a shared machine run-to-run noise can exceed the effect, so it also measures the cost
directly: the CPU time (all threads, export included) that tracing spends per job, from
the same code the API and worker run (`RequestTrace`, `record_attempt`), exported to the
same sink; and that cost as a share of each run's time per job (`--micro-jobs 0`: skip).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from api.jobs.trace import RequestTrace
from loadtest.bench_serve import bench_http, running_service, spare_port
from loadtest.single_stream import cpu_description
from loadtest.workload import LevelResult, Workload
from shared import tracing
from shared.contracts import ChoiceEnd, DoneEvent, JobPayload, Usage
from worker.job_state import JobState
from worker.tracing import record_attempt


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


def traced_job(index: int, loop: asyncio.AbstractEventLoop) -> None:
    """Every span one job makes, API and worker side, with realistic timestamps."""
    now = time.time()
    payload = JobPayload(
        id=f"job-{index}", endpoint="chat.completions", model="m", prompt_token_ids=[1, 2, 3]
    )
    trace = RequestTrace("/v1/chat/completions", payload, start=now)
    with trace.enqueue():
        pass
    job = JobState.create(payload, 1, payload.prompt_token_ids, loop, picked_at=now)
    job.timings.scheduled_at = job.timings.first_token_at = job.last_token_at = time.time()
    job.timings.finished_at = time.time()
    trace.relay_started()
    record_attempt(job, "w", "completed", (time.time(), time.time()))
    done = DoneEvent(choices=[ChoiceEnd(index=0, finish_reason="stop")], usage=Usage())
    trace.finish(done)


def micro_cost(sink: OtlpSink, num_jobs: int) -> float:
    """CPU seconds per job that tracing costs, export to the sink included."""
    loop = asyncio.new_event_loop()
    tracing.configure(sink.url, "ladle-bench")
    started = time.process_time()
    try:
        for index in range(num_jobs):
            traced_job(index, loop)
    finally:
        tracing.shutdown()  # flushes: the export's CPU is counted
        loop.close()
    return (time.process_time() - started) / num_jobs


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


def report_micro(cost_s: float, runs: list[tuple[bool, LevelResult]], num_jobs: int) -> None:
    print(f"\ntracing CPU per job: {cost_s * 1e6:.0f} us ({num_jobs} jobs, 10 spans each)")
    for i, (traced, r) in enumerate(runs, 1):
        jobs_per_s = r.requests_per_s
        print(
            f"run {i} ({'on' if traced else 'off'}): {jobs_per_s:.2f} jobs/s -> tracing would "
            f"take {100 * cost_s * jobs_per_s:.3f} % of one core"
        )


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
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs (2; 0: CPU cost only)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=300.0, help="limit per run")
    parser.add_argument("--micro-jobs", type=int, default=2000, help="jobs for the CPU cost")
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
        cost_s = micro_cost(sink, args.micro_jobs) if args.micro_jobs else None
    finally:
        sink.close()
    if runs:
        report(runs, sink, load)
    if cost_s is not None:
        report_micro(cost_s, runs, args.micro_jobs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where the service's CPU goes: CPU seconds per process per generated token, under load.

    python -m loadtest.profile_serve --concurrency 16 --num-prompts 32 --output-len 64
    LLM_NUM_THREADS=1 python -m loadtest.profile_serve ...   # the worker's torch threads

Starts the service as bench_serve --compare does (`ladle up --workers 1`, private Redis),
warms it up, then reads utime+stime (/proc/<pid>/stat) of the API, the worker, redis-server
and this client before and after one closed-loop level, and prints each process's CPU
seconds, its share of the wall time and its CPU milliseconds per output token, next to the
level's tokens/s, median ITL and TTFT. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

from loadtest.bench_serve import OpenAIStreamClient, running_service
from loadtest.workload import SendFn, Workload, run_level, summarize

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread of a process, keyed by name:tid (the main thread marked)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        label = f"{name}:{tid}" + (" main" if int(tid) == pid else "")
        out[label] = (int(fields[11]) + int(fields[12])) / TICKS
    return out


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def service_pids() -> dict[str, int]:
    """The API, worker(s) and redis-server of the service started by this process."""
    launcher = next(
        p for p in _all_pids() if _ppid(p) == os.getpid() and "-m ladle " in _cmdline(p)
    )
    pids: dict[str, int] = {}
    for pid in _all_pids():
        try:
            cmd, parent = _cmdline(pid), _ppid(pid)
        except OSError:
            continue
        if parent == launcher and " -m api" in cmd:
            pids["api"] = pid
        elif parent == launcher and " -m worker" in cmd:
            pids[f"worker{len([k for k in pids if k.startswith('worker')])}"] = pid
        elif parent == os.getpid() and "redis-server" in cmd:
            pids["redis"] = pid
    pids["client"] = os.getpid()
    return pids


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


async def profile(
    base_url: str, pids: dict[str, int], workload: Workload, conc: int, idle_s: float
) -> None:
    client = OpenAIStreamClient(base_url, None, workload, max_connections=conc + 4)
    try:
        await client.prepare()
        if idle_s > 0:
            await measure_idle(pids, idle_s)
        await measure(client.send, pids, workload, conc)
    finally:
        await client.aclose()


async def profile_engine(workload: Workload, conc: int) -> None:
    from loadtest.bench_serve import EngineDriver, build_engine

    driver = EngineDriver(build_engine(), workload)
    try:
        await driver.prepare()
        await measure(driver.send, {"engine": os.getpid()}, workload, conc)
    finally:
        await asyncio.to_thread(driver.close)


async def measure_idle(pids: dict[str, int], seconds: float) -> None:
    """CPU each process spends with no request at all: polls, heartbeats, timers. Under
    load it competes with the engine for the same cores."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    await asyncio.sleep(seconds)
    print(f"idle {seconds:.0f} s:")
    for name, pid in pids.items():
        used = cpu_seconds(pid) - before[name]
        print(f"  {name:8s} {used:7.2f} CPU s  {100 * used / seconds:5.1f} % of a core")


async def measure(send: SendFn, pids: dict[str, int], workload: Workload, conc: int) -> None:
    """Run one level with `send`, printing CPU seconds per process and per thread."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads_before = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
    started = time.perf_counter()
    records, duration = await run_level(send, workload.prompts(0), conc, 600.0)
    wall = time.perf_counter() - started
    after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    threads_after = {name: thread_cpu_seconds(pid) for name, pid in pids.items()}
    result = summarize(conc, records, duration)
    tokens = max(result.output_tokens, 1)
    print(
        f"concurrency {conc}: {result.num_ok} ok, {result.num_failed} failed, "
        f"{result.output_tokens_per_s:.1f} tok/s, median ITL {result.itl_ms.median:.1f} ms, "
        f"median TTFT {result.ttft_ms.median:.0f} ms, wall {wall:.1f} s, load "
        f"{os.getloadavg()[0]:.2f}"
    )
    total = 0.0
    for name in pids:
        used = after[name] - before[name]
        total += used
        print(
            f"  {name:8s} {used:7.2f} CPU s  {100 * used / wall:5.1f} % of a core  "
            f"{1000 * used / tokens:6.2f} ms/token"
        )
        for thread, end in sorted(threads_after[name].items()):
            used_t = end - threads_before[name].get(thread, 0.0)
            if used_t > 0.05:
                print(
                    f"    {thread:22s} {used_t:7.2f} CPU s  {1000 * used_t / tokens:6.2f} ms/token"
                )
    print(f"  {'total':8s} {total:7.2f} CPU s  {100 * total / wall:5.1f} % of a core")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", action="store_true", help="the engine in this process instead")
    p.add_argument(
        "--idle-seconds", type=float, default=0.0, help="first, each process's CPU with no load"
    )
    args = p.parse_args(argv)
    workload = Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    if args.engine:
        asyncio.run(profile_engine(workload, args.concurrency))
        return 0
    with running_service(1) as base_url:
        pids = service_pids()
        print("processes:", pids, flush=True)
        asyncio.run(profile(base_url, pids, workload, args.concurrency, args.idle_seconds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

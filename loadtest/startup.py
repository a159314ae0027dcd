"""Start-up time: `python -m ladle up` to `/ready` 200, with an empty cache and a warm one.

    python -m loadtest.startup                  # cold (empty LLM_CACHE_DIR), then warm, once each
    python -m loadtest.startup --runs 3 --json out.json

Each run starts `ladle up --workers 1` on the default model (or `--model`) with its own Redis
and LLM_CACHE_DIR (a fresh empty one for the cold run, the same one again for the warm run),
polls `/ready` every 0.1 s, then stops it. What each second went to comes from the log: the
time of each start-up milestone (native kernels, GGUF conversion, model load, kernel plan,
engine ready) after the launch.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from loadtest.bench_serve import private_redis, spare_port, stop_process, tail

# log message pattern -> milestone name (the first match of each counts)
MILESTONES = {
    r"^native kernels (built|loaded)": "native kernels",
    r"^converted GGUF": "GGUF converted",
    r"^model .* loaded in": "model loaded",
    r"^linear kernels": "kernel plan",
    r"^engine ready": "engine ready",
    r"^worker .* ready": "worker polling",
}


def run_once(cache_dir: Path, model: str | None, timeout_s: float) -> dict[str, Any]:
    """One `ladle up` to `/ready`; seconds to ready and to each milestone in the log."""
    port = spare_port()
    log_path = Path(tempfile.gettempdir()) / f"ladle-startup-{port}.log"
    with private_redis() as redis_url:
        env = dict(
            os.environ,
            LLM_CACHE_DIR=str(cache_dir),
            LLM_KEY_PREFIX=f"startup-{port}",
            LLM_WORKER_METRICS_PORT="0",
            LLM_SUPERVISOR_METRICS_PORT="0",
            LLM_LOG_LEVEL="INFO",
        )
        argv = [sys.executable, "-m", "ladle", "up", "--workers", "1", "--port", str(port)]
        argv += ["--redis-url", redis_url, "--no-start-redis"]
        if model:
            argv += ["--model", model]
        started_wall = time.time()
        started = time.perf_counter()
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            ready_s = _wait_ready(f"http://127.0.0.1:{port}/ready", proc, started, timeout_s)
            cpu_s = tree_cpu_seconds(proc.pid)
        finally:
            stop_process(proc)
    if ready_s is None:
        raise RuntimeError(f"not ready after {timeout_s:.0f} s; log tail:\n{tail(log_path)}")
    return {"ready_s": round(ready_s, 2), "cpu_s": cpu_s, **milestones(log_path, started_wall)}


def tree_cpu_seconds(root_pid: int) -> float:
    """CPU seconds used so far by `root_pid` and every process under it (the supervisor
    starts its children in sessions of their own), with their finished children (the
    compiler): on a busy machine wall time says little, this less."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent pid, clock ticks)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
        stats[int(stat.parent.name)] = (int(fields[1]), ticks)
    tree, todo = {root_pid}, [root_pid]
    while todo:
        parent = todo.pop()
        children = [pid for pid, (ppid, _) in stats.items() if ppid == parent]
        tree.update(children)
        todo.extend(children)
    total = sum(stats[pid][1] for pid in tree if pid in stats)
    return round(total / os.sysconf("SC_CLK_TCK"), 1)


def _wait_ready(url: str, proc: subprocess.Popen, started: float, timeout_s: float) -> float | None:
    while time.perf_counter() - started < timeout_s:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=2.0) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    return None


def milestones(log_path: Path, started_wall: float) -> dict[str, float]:
    """Seconds after the launch at which each milestone's log line was written."""
    found: dict[str, float] = {}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        for pattern, name in MILESTONES.items():
            if name not in found and re.search(pattern, record.get("msg", "")):
                at = datetime.fromisoformat(record["ts"].replace("Z", "+00:00")).timestamp()
                found[name] = round(at - started_wall, 2)
    return found


def format_rows(rows: list[dict[str, Any]]) -> str:
    names = list(MILESTONES.values())
    lines = [
        "| start | " + " | ".join(names) + " | /ready | CPU s | load |",
        "|---" * (len(names) + 4) + "|",
    ]
    for row in rows:
        cells = [f"{row[n]:.1f}" if n in row else "-" for n in names]
        end = f" | **{row['ready_s']:.1f}** | {row['cpu_s']:.0f} | {row['load']} |"
        lines.append(f"| {row['start']} | " + " | ".join(cells) + end)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.startup", description=__doc__)
    parser.add_argument("--runs", type=int, default=1, help="cold + warm pairs")
    parser.add_argument("--model", help="LLM_MODEL_NAME (default: the default model)")
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ladle-cache-") as cache_dir:
            for start in ("cold", "warm"):
                row = {"start": start, "load": round(os.getloadavg()[0], 1)}
                row.update(run_once(Path(cache_dir), args.model, args.timeout_s))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

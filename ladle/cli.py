"""`ladle` (`python -m ladle`): run the whole service, or one of its processes.

    ladle up [--workers N] [--port P] [--model M]   Redis (found or started), API, N workers,
                                                    restarted when they crash
    ladle up --worker [NAME=]MODEL[:COUNT] ...      workers for several models
    ladle batch submit FILE.jsonl | status ID | cancel ID    the Batch API from a shell
    ladle api [ARGS...]                             python -m api ARGS
    ladle worker [ARGS...]                          python -m worker ARGS
    ladle generate [ARGS...]                        python -m worker.engine.cli ARGS (no Redis)

`api`, `worker` and `generate` hand over to the module (exec), so `ladle api --help` prints
that module's own help.
"""

from __future__ import annotations

import argparse
import os
import sys

from ladle import batch_cli
from ladle.launcher import UpOptions, WorkerGroup, run_up

# Subcommands that exec a module with the rest of the command line.
PASSTHROUGH = {
    "api": ("api", "run the API server alone (python -m api)"),
    "worker": ("worker", "run one worker alone (python -m worker)"),
    "generate": (
        "worker.engine.cli",
        "generate text in-process, no Redis or API (python -m worker.engine.cli)",
    ),
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _worker_group(text: str) -> WorkerGroup:
    try:
        return WorkerGroup.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ladle",
        description="Ladle: an OpenAI-compatible LLM service (API + Redis queue + workers). "
        "Settings come from LLM_* environment variables and .env; flags override.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser(
        "up",
        help="run Redis (if none answers), the API and N workers until Ctrl-C",
        description="Use the Redis at LLM_REDIS_URL if it answers, else start a private "
        "redis-server, else an embedded broker (fakeredis; for trying Ladle out, "
        "not production). Then start the API and the workers, wait until GET "
        "/ready answers 200, and print where to point a client. A process that exits "
        "on its own is restarted (LLM_RESTART_BACKOFF_S doubling to "
        "LLM_RESTART_BACKOFF_MAX_S) until it crashes LLM_CRASH_LOOP_MAX_CRASHES times "
        "within LLM_CRASH_LOOP_WINDOW_S; the others keep serving. Runs until Ctrl-C, "
        "which stops everything gracefully (twice: at once).",
    )
    up.add_argument("--workers", type=_positive_int, default=1, help="worker processes (1)")
    up.add_argument(
        "--worker",
        dest="worker_groups",
        action="append",
        type=_worker_group,
        default=[],
        metavar="[NAME=]MODEL[:COUNT]",
        help="COUNT workers (1) for MODEL (a name, HF directory or .gguf), served as NAME "
        "(default: its file or directory name); repeat for several models; replaces "
        "--workers. Without --model, the first one is the API's default model",
    )
    up.add_argument("--host", help="API bind address (LLM_HOST, default 127.0.0.1)")
    up.add_argument("--port", type=int, help="API port (LLM_PORT, default 8000)")
    up.add_argument("--model", help="model name, HF directory or .gguf file (LLM_MODEL_NAME)")
    up.add_argument("--redis-url", help="Redis to use first (LLM_REDIS_URL)")
    up.add_argument(
        "--no-start-redis",
        dest="start_redis",
        action="store_false",
        help="fail instead of starting a Redis when none answers",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="log an error if the API is not ready after S seconds (600); it keeps trying",
    )
    up.add_argument(
        "--shutdown-timeout",
        type=float,
        metavar="S",
        help="wait S seconds for children to stop before killing them "
        "(LLM_SHUTDOWN_TIMEOUT_S + 15: the workers' drain, then hand-back)",
    )
    batch_cli.add_parser(commands)
    for name, (_module, summary) in PASSTHROUGH.items():
        commands.add_parser(
            name,
            help=summary,
            add_help=False,
            description=f"{summary}; `ladle {name} --help` shows its flags",
        )
    return parser


def options_from_args(args: argparse.Namespace) -> UpOptions:
    return UpOptions(
        num_workers=args.workers,
        worker_groups=args.worker_groups,
        host=args.host,
        port=args.port,
        model=args.model,
        redis_url=args.redis_url,
        start_redis=args.start_redis,
        ready_timeout_s=args.ready_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
    )


def exec_module(module: str, argv: list[str]) -> None:
    """Replace this process with `python -m module argv...`."""
    os.execv(sys.executable, [sys.executable, "-m", module, *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH:
        exec_module(PASSTHROUGH[argv[0]][0], argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "batch":
        return batch_cli.run(args)
    return run_up(options_from_args(args))


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m worker`: the command line; flags over settings, then one worker process."""

from __future__ import annotations

import argparse
import asyncio
import logging

from shared.config import settings_with
from shared.errors import EXIT_CONFIG_ERROR
from shared.logging import setup_logging
from worker.models.errors import ModelConfigError
from worker.process import WorkerProcess


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker",
        description="Run one Ladle worker: loads the model, takes completion jobs from Redis "
        "(arq), runs them in the continuous-batching engine and streams tokens "
        "back. Settings come from LLM_* environment variables and .env.",
    )
    parser.add_argument("--model", help="overrides LLM_MODEL_NAME")
    parser.add_argument(
        "--served-model-name", help="the name clients use (overrides LLM_SERVED_MODEL_NAME)"
    )
    parser.add_argument("--redis-url", help="overrides LLM_REDIS_URL")
    parser.add_argument("--worker-id", help="overrides LLM_WORKER_ID")
    parser.add_argument("--metrics-port", type=int, help="overrides LLM_WORKER_METRICS_PORT")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_with(
        model_name=args.model,
        served_model_name=args.served_model_name,
        redis_url=args.redis_url,
        worker_id=args.worker_id,
        worker_metrics_port=args.metrics_port,
    )
    setup_logging(settings.log_level)
    try:
        asyncio.run(WorkerProcess(settings).run())
    except ModelConfigError as exc:  # one line, no traceback: the reason is the message
        logging.getLogger("worker").error("refused to serve %s: %s", settings.model_name, exc)
        return EXIT_CONFIG_ERROR
    return 0

"""`python -m api`: serve the API with uvicorn (settings from LLM_* variables and .env)."""

from __future__ import annotations

import argparse

from shared.config import settings_with
from shared.logging import setup_logging


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m api",
        description="Ladle's OpenAI-compatible HTTP API. It enqueues jobs into Redis and "
        "relays worker events; configure it with LLM_* variables (see shared/config.py).",
    )
    parser.add_argument("--host", help="bind address (LLM_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port (LLM_PORT, default 8000)")
    parser.add_argument("--redis-url", help="Redis URL (LLM_REDIS_URL)")
    parser.add_argument("--log-level", help="log level (LLM_LOG_LEVEL, default INFO)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    settings = settings_with(
        host=args.host, port=args.port, redis_url=args.redis_url, log_level=args.log_level
    )
    setup_logging(settings.log_level)
    from api.app import create_app
    from api.server import serve

    serve(create_app(settings), settings)


if __name__ == "__main__":
    main()

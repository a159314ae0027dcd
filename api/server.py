"""uvicorn, with a graceful shutdown that ends open streams cleanly instead of cutting them."""

from __future__ import annotations

from types import FrameType

import uvicorn
from fastapi import FastAPI

from shared.config import Settings

# Open streams end this long before uvicorn's own deadline, which cancels what is left.
_MARGIN_S = 1.0


class LadleServer(uvicorn.Server):
    """On SIGTERM/SIGINT uvicorn stops accepting and waits `LLM_SHUTDOWN_TIMEOUT_S` for
    open requests. Ours finish if they can; the rest get a 503 `server_shutting_down`
    error (an SSE error chunk, or the response) shortly before that deadline. Their jobs are
    not cancelled: they run on and are fetched with `GET /v1/jobs/{id}`."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace_s: float) -> None:
        super().__init__(config)
        self.ladle_app = app
        self.grace_s = grace_s

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.ladle_app.state.services.relay.begin_shutdown(self.grace_s)
        super().handle_exit(sig, frame)


def serve(app: FastAPI, settings: Settings) -> None:
    """Run the app until a signal; see `LadleServer`."""
    timeout = settings.shutdown_timeout_s
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=timeout,
    )
    LadleServer(config, app, grace_s=max(0.0, timeout - _MARGIN_S)).run()

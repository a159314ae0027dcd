"""The web console: static files (no build step, nothing fetched from elsewhere) at `/` and
`/console`. The files hold no data: the page asks for an API key and calls the JSON routes."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

from api.errors import APIError

CONSOLE_DIR = Path(__file__).parent / "static"
_MEDIA_TYPES = {".html": "text/html", ".css": "text/css", ".js": "text/javascript"}
# The page may talk to this origin only, and runs only its own scripts and styles.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
_AUTH_MARK = "{{auth}}"

router = APIRouter(include_in_schema=False)


def _load() -> dict[str, tuple[bytes, str]]:
    return {
        path.name: (path.read_bytes(), _MEDIA_TYPES[path.suffix])
        for path in sorted(CONSOLE_DIR.iterdir())
        if path.suffix in _MEDIA_TYPES
    }


_FILES = _load()


@router.get("/")
@router.get("/console")
async def console_page(request: Request) -> Response:
    """The page; it says whether keys are on, so it asks for one before any call fails."""
    body, media_type = _FILES["index.html"]
    required = bool(request.app.state.services.settings.api_keys)
    page = body.replace(_AUTH_MARK.encode(), b"required" if required else b"none")
    return Response(page, media_type=f"{media_type}; charset=utf-8", headers=_HEADERS)


@router.get("/console/{name}")
async def console_file(name: str) -> Response:
    if name not in _FILES or name == "index.html":
        raise APIError(404, f"No console file '{name}'", code="not_found")
    body, media_type = _FILES[name]
    return Response(body, media_type=f"{media_type}; charset=utf-8", headers=_HEADERS)

"""The grid's llama-server falls back to a build without AMX where the native one dies of
SIGILL or SIGSEGV before it is ready."""

from __future__ import annotations

import os
import stat
import sys
import urllib.request
from pathlib import Path

import pytest

from loadtest import llama_server

DIES = "#!/bin/sh\nkill -ILL $$\n"
CRASHES = "#!/bin/sh\nkill -SEGV $$\n"
EXITS = "#!/bin/sh\nexit 3\n"
# Answers /health on the port after --port, as llama-server does once its model is loaded.
SERVES = f"""#!{sys.executable}
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def fake_builds(tmp_path: Path, native: str, noamx: str) -> list[bool]:
    """Both builds' binaries in place under `tmp_path`; returns the log of builds asked for."""
    for build, text in (("build", native), ("build-noamx", noamx)):
        binary = tmp_path / build / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text(text)
        binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return []


def serve(tmp_path: Path, asked: list[bool], monkeypatch: pytest.MonkeyPatch) -> str:
    real = llama_server.ensure_llama_server

    def ensure(cache: Path | None = None, without_amx: bool = False) -> Path:
        asked.append(without_amx)
        return real(cache, without_amx=without_amx)

    monkeypatch.setattr(llama_server, "ensure_llama_server", ensure)
    with llama_server.llama_server_for_this_cpu(
        Path("model.gguf"), 2, 4, 256, cache=tmp_path
    ) as url:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=10) as reply:
            assert reply.status == 200
        return url


@pytest.mark.skipif(os.name != "posix", reason="signals")
@pytest.mark.parametrize("death", [DIES, CRASHES], ids=["sigill", "sigsegv"])
def test_a_native_build_that_dies_falls_back_to_the_build_without_amx(
    death: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = fake_builds(tmp_path, death, SERVES)
    url = serve(tmp_path, asked, monkeypatch)
    assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
    assert asked == [False, True]


def test_a_native_build_that_starts_is_used_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = fake_builds(tmp_path, SERVES, DIES)
    serve(tmp_path, asked, monkeypatch)
    assert asked == [False]


def test_any_other_early_exit_is_reported_not_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = fake_builds(tmp_path, EXITS, SERVES)
    with pytest.raises(RuntimeError, match="exited with 3") as failure:
        serve(tmp_path, asked, monkeypatch)
    assert not isinstance(failure.value, llama_server.NativeBuildDied)
    assert asked == [False]


def test_the_build_without_amx_turns_off_every_amx_extension() -> None:
    flags = " ".join(llama_server.NO_AMX_FLAGS)
    for ext in ("amx-tile", "amx-int8", "amx-bf16"):
        assert flags.count(f"-mno-{ext}") == 2  # C and C++

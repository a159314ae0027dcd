"""llama.cpp's own OpenAI server (`llama-server`), built from source for this CPU, for the grid.

PyPI carries llama.cpp's source inside the `llama-cpp-python` sdist (vendor/llama.cpp, with
tools/server); `ensure_llama_server` downloads that sdist with pip, and builds only the
`llama-server` target with cmake (GGML_NATIVE, no curl) under `.cache/llama.cpp-<version>`
(git-ignored): ~15 minutes on 2 idle cores, once. `running_llama_server` starts it on a spare
127.0.0.1 port with parallel slots and its continuous batching, and yields the /v1 base URL.
`llama_server_for_this_cpu` does both, and where the native build dies of SIGILL or SIGSEGV
before it is ready (both seen on Xeon VMs that list amx_* flags: an AMX instruction refused,
and a crash in ggml's AMX matmul), builds once more without AMX into `build-noamx` and serves
that one.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from loadtest.bench_serve import spare_port, stop_process, wait_ready

ROOT = Path(__file__).resolve().parent.parent
SDIST_VERSION = "0.3.36"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF",
]
# Explicit -mno-* flags win over what -march=native implies, whatever their order in GCC.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
NO_AMX_FLAGS = [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


class LlamaServerUnavailable(RuntimeError):
    """llama-server could not be built or started; the message says why."""


class NativeBuildDied(LlamaServerUnavailable):
    """The binary died of SIGILL or SIGSEGV before it was ready: its AMX code does not run on
    this VM (an instruction refused, or ggml's AMX matmul crashing)."""


# The signals a native build's AMX code died of before it was ready, on Xeon VMs.
AMX_CRASHES = (signal.SIGILL, signal.SIGSEGV)


def _run(argv: list[str], timeout_s: float, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        raise LlamaServerUnavailable(f"{' '.join(argv[:4])} timed out") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise LlamaServerUnavailable(f"{' '.join(argv[:4])} failed ({done.returncode}):\n{tail}")


def source_dir(cache: Path, version: str) -> Path:
    """llama.cpp's source as vendored in the llama-cpp-python sdist, downloaded once."""
    src = cache / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "tools" / "server").is_dir():
        return src
    cache.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    _run(pip + ["-d", str(cache), f"llama-cpp-python=={version}"], 600)
    with tarfile.open(cache / f"llama_cpp_python-{version}.tar.gz") as sdist:
        sdist.extractall(cache, filter="data")
    return src


def ensure_llama_server(
    cache: Path | None = None, version: str = SDIST_VERSION, without_amx: bool = False
) -> Path:
    """The `llama-server` binary, built for this CPU (less AMX if asked) unless already built."""
    cache = cache or ROOT / ".cache" / f"llama.cpp-{version}"
    build = cache / ("build-noamx" if without_amx else "build")
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    src = source_dir(cache, version)
    flags = CMAKE_FLAGS + (NO_AMX_FLAGS if without_amx else [])
    kind = " without AMX" if without_amx else ""
    print(f"building llama-server{kind} from source (about 15 minutes, once)...", flush=True)
    _run(["cmake", "-S", str(src), "-B", str(build), *flags], 600)
    _run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"], 7200)
    return binary


@contextlib.contextmanager
def running_llama_server(
    binary: Path, gguf: Path, threads: int, slots: int, slot_context: int, ready_s: float = 300
) -> Iterator[str]:
    """`llama-server` with `slots` parallel sequences of `slot_context` tokens each."""
    port = spare_port()
    log_path = Path(tempfile.gettempdir()) / f"llama-server-{port}.log"
    argv = [
        str(binary),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-t", str(threads), "-tb", str(threads), "-np", str(slots)),
        *("-c", str(slots * slot_context), "--cont-batching", "--no-webui"),
    ]
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        try:
            wait_ready(f"http://127.0.0.1:{port}/health", proc, ready_s, log_path)
        except RuntimeError as exc:
            if proc.returncode in [-sig for sig in AMX_CRASHES]:
                raise NativeBuildDied(f"{binary}: {exc}") from exc
            raise
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(proc)


@contextlib.contextmanager
def llama_server_for_this_cpu(
    gguf: Path, threads: int, slots: int, slot_context: int, cache: Path | None = None
) -> Iterator[str]:
    """The native build served; where it dies of SIGILL or SIGSEGV, the build without AMX."""
    with contextlib.ExitStack() as stack:
        args = (gguf, threads, slots, slot_context)
        try:
            url = stack.enter_context(running_llama_server(ensure_llama_server(cache), *args))
        except NativeBuildDied as exc:
            print(f"{exc}\nfalling back to a build without AMX", file=sys.stderr, flush=True)
            binary = ensure_llama_server(cache, without_amx=True)
            url = stack.enter_context(running_llama_server(binary, *args))
        yield url


def main() -> int:
    print(ensure_llama_server())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python -m worker.prepare`: the one-time work of a first start, done at `make install`.

Builds Ladle's native kernels for this CPU (and times their prefetch level and, with AMX, the
int4 kernels once) and converts the default model's GGUF into an HF directory, both inside
the environment (`{sys.prefix}/share/ladle/`), where a worker with an empty cache
(`LLM_CACHE_DIR`) finds them: its first start then skips ~20 s of compiling and ~12 s of
converting (docs/benchmarks.md, "Start-up"). Each part that fails says why and is
left to the first start, as before; the command exits 0.
"""

from __future__ import annotations

import argparse
import logging
import subprocess
import sys
import time

from shared.model_files import DEFAULT_MODEL_NAME, converted_dir, installed_root, resolve_model
from worker.layers import native
from worker.models.errors import ModelConfigError
from worker.models.gguf_convert import convert_gguf

logger = logging.getLogger("worker.prepare")


def prepare_native() -> None:
    started = time.perf_counter()
    try:
        path = native.prebuild(native.installed_dir())
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernels not prebuilt (%s): they build at first start", exc)
        return
    if path is None:
        logger.warning("no C++ compiler: the native kernels are not built")
        return
    logger.info("native kernels: %s (%.1f s)", path, time.perf_counter() - started)
    native.load()  # times the prefetch level and int4 kernels once, kept beside the build


def prepare_model(ref: str) -> None:
    started = time.perf_counter()
    try:
        source = resolve_model(ref)
        if source.kind != "gguf":
            return  # an HF directory needs no conversion
        target = converted_dir(source, root=installed_root())
        if not (target / "model.safetensors").exists():
            convert_gguf(source.path, target)
    except (OSError, ValueError, ModelConfigError) as exc:
        logger.warning("%s not converted (%s): it converts at first start", ref, exc)
        return
    logger.info("%s converted: %s (%.1f s)", ref, target, time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.prepare", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="a model to convert")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prepare_native()
    prepare_model(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())

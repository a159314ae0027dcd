"""`python -m worker.layers.native`: build the native kernels into the environment (make install).

A start with an empty cache then loads them in milliseconds instead of compiling for ~20 s.
Without a compiler, or where the build fails, it says so and exits 0: they build at first start.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from worker.layers import native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.layers.native", description=__doc__)
    parser.add_argument("--into", type=Path, default=native.installed_dir(), help="directory")
    args = parser.parse_args(argv)
    try:
        path = native.prebuild(args.into)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        print(f"native kernels not prebuilt ({exc}); they build at first start", file=sys.stderr)
        return 0
    print(f"native kernels: {path}" if path else "no C++ compiler: native kernels not prebuilt")
    return 0


if __name__ == "__main__":
    sys.exit(main())

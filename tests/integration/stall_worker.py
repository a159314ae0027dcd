"""`python -m tests.integration.stall_worker`: a real worker whose engine steps block while
the file named by LADLE_TEST_STALL_FILE exists, standing in for a hung kernel."""

from __future__ import annotations

import os
import time

from worker.engine.engine import LLMEngine
from worker.main import main

_real_step = LLMEngine.step


def _step(self: LLMEngine):  # noqa: ANN202
    while os.path.exists(os.environ["LADLE_TEST_STALL_FILE"]):
        time.sleep(0.05)
    return _real_step(self)


if __name__ == "__main__":
    LLMEngine.step = _step  # type: ignore[method-assign]
    raise SystemExit(main())

"""The chaos run, short (LADLE_CHAOS_S, default 120 s): mixed load on `ladle up` with three
workers while workers are SIGKILLed, one is SIGSTOPped past its lease, Redis (AOF) and the API
restart. The ledger must show nothing lost or duplicated, no wrong output, every batch line
answered once, no KV block or running sequence left, no undocumented 5xx."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from loadtest.chaos import ChaosConfig, markdown, run

pytestmark = pytest.mark.chaos


def test_chaos_ledger_is_clean(tmp_path: Path) -> None:
    seconds = float(os.environ.get("LADLE_CHAOS_S", "120"))
    config = ChaosConfig(
        seconds=seconds, workers=3, clients=4, batch_every=seconds / 3, batch_lines=8
    )
    ledger = asyncio.run(run(config, tmp_path))
    print(markdown(ledger, config))
    assert ledger.problems() == [], ledger.details
    assert ledger.completed > 0 and ledger.batch_lines > 0
    assert len(ledger.faults) >= 5  # kills, the stop and resume, Redis, the API

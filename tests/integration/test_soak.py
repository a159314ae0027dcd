"""A short soak (loadtest/soak.py) on the tiny model: 40 streaming clients for 6 s, a tenth
of them leaving early. No 5xx, every job final, workers idle, per-job keys expire; RSS is
logged with a loose bound (the full soak, with the 10 % bound, is `python -m loadtest.soak`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from loadtest.soak import SoakConfig, soak, wait_keys_expire
from tests.support.harness import TEST_REDIS_URL, start_service

log = logging.getLogger(__name__)
CONFIG = SoakConfig(
    clients=40,
    seconds=6.0,
    disconnect_fraction=0.1,
    max_tokens=16,
    warmup_s=1.5,
    job_ttl_s=2,
    rss_tolerance=0.5,
    settle_s=0.5,
)


def test_short_soak(tiny_service_model: Path, tmp_path: Path) -> None:
    service = start_service(
        tiny_service_model,
        tmp_path / "logs",
        job_ttl_s=CONFIG.job_ttl_s,
        first_event_timeout_s=120,
        request_timeout_s=300,
    )
    try:
        assert service.api is not None and service.workers[0] is not None
        pids = {"api": service.api.pid, "worker": service.workers[0].pid}
        with service.client() as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
        report = asyncio.run(soak(service.base_url, model, CONFIG, pids))
        wait_keys_expire(report, TEST_REDIS_URL, service.prefix, CONFIG.job_ttl_s)
    finally:
        service.stop()
    log.warning(
        "soak: %s requests, statuses %s, final %s, RSS %s",
        report.requests,
        report.statuses,
        report.final_states,
        report.rss_kib,
    )
    assert report.requests >= 40 and report.disconnected >= 1
    assert report.statuses == {"200": report.requests}  # no 5xx, nothing unexpected
    assert sum(report.final_states.values()) == report.requests
    assert report.final_states.get("completed", 0) >= report.completed_streams
    assert report.kv_idle_after_s is not None
    assert report.leftover_job_keys == 0
    assert report.problems == [], report.problems
    if report.problems:
        pytest.fail("\n".join(report.problems))

"""The Sentinel primary SIGKILLed under load: every accepted job ends with its answer or a
documented error, nothing is answered twice, no client sees a 500, and the service recovers
by itself (no process restarted).

One primary, one replica, three sentinels (all redis-server); the API and two workers of the
tiny model on `redis+sentinel://`; six clients of mixed requests (sync, streaming, job API
with polling) from `loadtest.chaos_load`, each answer checked against the reference answer
taken before the fault. The long version, with two kills: `python -m loadtest.chaos
--sentinel` (docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from loadtest.chaos_load import Clients, Ledger, poll_job
from loadtest.chaos_sweep import check_redis, wait_idle
from shared.keys import Keys
from tests.support.harness import start_service
from tests.support.redis_topology import REDIS_SERVER, sentinel_group

pytestmark = pytest.mark.skipif(
    not REDIS_SERVER.startswith("/"), reason="needs redis-server and redis-cli on PATH"
)
NUM_CLIENTS = 6
LOAD_BEFORE_S = 4.0  # load before the kill, and at least as long after the new primary
LOAD_AFTER_S = 6.0


async def _load_through_a_failover(base_url: str, group: object, ledger: Ledger) -> float:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        clients = Clients(base_url, model, 12, ledger)
        for prompt in ("w5 w17 w99 w42", "w7 w128 w64", "w11 w12 w13 w14 w15", "w300 w2 w9"):
            for kind in ("sync", "stream"):
                await clients.one(http, kind, prompt)  # the reference answers
        ledger.sent = ledger.completed = 0
        started = time.monotonic()
        load = asyncio.create_task(clients.run(NUM_CLIENTS, started + 120))
        await asyncio.sleep(LOAD_BEFORE_S)
        failover_s = await asyncio.to_thread(group.kill_primary)  # type: ignore[attr-defined]
        completed_at_failover = ledger.completed
        deadline = time.monotonic() + 60
        while ledger.completed < completed_at_failover + 20 or time.monotonic() < (
            started + LOAD_BEFORE_S + failover_s + LOAD_AFTER_S
        ):
            assert time.monotonic() < deadline, f"no recovery after the failover: {ledger}"
            await asyncio.sleep(0.2)
        clients_stop = time.monotonic()
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)
        for job_id in list(ledger.job_ids):  # jobs whose client was cut off by the end
            job = await poll_job(http, job_id, deadline=clients_stop + 60)
            ledger.lost += job is None or job["status"] == "missing"
        return failover_s


def test_primary_killed_under_load_loses_and_repeats_nothing(
    tiny_service_model: Path, tmp_path: Path
) -> None:
    with sentinel_group(tmp_path / "redis") as group:
        svc = start_service(
            tiny_service_model, tmp_path / "logs", num_workers=2, redis_url=group.url
        )
        try:
            ledger = Ledger()
            failover_s = asyncio.run(_load_through_a_failover(svc.base_url, group, ledger))
            with svc.client() as http:
                asyncio.run(_idle(svc.base_url, ledger))
                assert http.get("/ready").status_code == 200
            check_redis(group.url, Keys(svc.prefix), ledger)
            assert svc.is_alive(), "a process died: recovery must not need a restart"
        finally:
            svc.stop()
    print(f"failover {failover_s:.1f} s; ledger {ledger.as_dict()}")
    assert ledger.problems() == [], ledger.details
    assert ledger.completed > 20 and ledger.lost == 0 and ledger.duplicated == 0


async def _idle(base_url: str, ledger: Ledger) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        await wait_idle(2, http, ledger)

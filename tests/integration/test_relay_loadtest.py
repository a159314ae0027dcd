"""A short run of `loadtest/relay.py` (the relay benchmark): raw and real clients, one Redis
and a 3-master cluster, every token published reaches a reader and nothing errs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import relay
from tests.support.redis_topology import REDIS_SERVER

pytestmark = pytest.mark.skipif(
    not REDIS_SERVER.startswith("/"), reason="needs redis-server and redis-cli on PATH"
)


@pytest.mark.parametrize(("client", "shards"), [("raw", "0,cluster"), ("real", "0")])
def test_relay_benchmark_delivers_what_it_publishes(
    client: str, shards: str, tmp_path: Path
) -> None:
    out = tmp_path / "relay.json"
    relay.main(
        ["--client", client, "--streams", "40", "--rates", "20", "--seconds", "4"]
        + ["--warmup-s", "1", "--publishers", "1", "--readers", "1", "--shards", shards]
        + ["--json", str(out)]
    )
    results = json.loads(out.read_text())["results"]
    assert [r["topology"] for r in results] == ["one Redis", "cluster of 3"][: len(results)]
    for result in results:
        assert result["delivered_tokens_per_s"] > 0 and result["latency_p99_ms"] > 0
        assert result["extra"]["publish_errors"] == 0
        assert result["extra"]["reads_per_s"] > 0
    if shards.endswith("cluster"):  # the streams are read from every master
        assert all(cpu > 0 for cpu in results[-1]["extra"]["redis_cpu_cores_per_server"])

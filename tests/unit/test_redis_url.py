"""`LLM_REDIS_URL` forms: Sentinel URLs for every client, unknown schemes refused, hash tags."""

from __future__ import annotations

from collections import Counter

import pytest
import redis.asyncio.sentinel
import redis.sentinel
from redis.crc import key_slot

from api.app import make_redis
from shared.config import Settings
from shared.keys import Keys, group_tag, stream_group
from shared.logging import safe_url
from shared.redis_url import (
    arq_redis_settings,
    async_pool,
    check_url,
    parse_sentinel_url,
    sync_client,
)
from shared.relay_shards import CLUSTER_STREAM_GROUPS, keys_for, shard_of

SENTINEL_URL = "redis+sentinel://:p%40ss@10.0.0.1:26379,10.0.0.2:26380,sent3/mymaster/2"


def test_sentinel_url_parses_hosts_master_db_and_password() -> None:
    target = parse_sentinel_url(SENTINEL_URL)
    assert target.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380), ("sent3", 26379)]
    assert (target.master, target.db, target.password, target.ssl) == ("mymaster", 2, "p@ss", False)


def test_sentinel_url_options_and_tls() -> None:
    target = parse_sentinel_url(
        "rediss+sentinel://u:pw@h:1/m?sentinel_password=s3&ssl_cert_reqs=none"
    )
    assert (target.username, target.password, target.sentinel_password) == ("u", "pw", "s3")
    assert target.ssl and target.db == 0 and target.options == {"ssl_cert_reqs": "none"}


@pytest.mark.parametrize(
    "url",
    [
        "redis+sentinel://h:1",
        "redis+sentinel:///m",
        "redis+sentinel://h:x/m",
        "redis+sentinel://h/m/db",
    ],
)
def test_malformed_sentinel_urls_are_refused_with_the_form(url: str) -> None:
    with pytest.raises(ValueError, match=r"host:port"):
        check_url(url)


@pytest.mark.parametrize("url", ["sentinel://h:1/m", "http://127.0.0.1:6379", "127.0.0.1:6379"])
def test_unknown_schemes_are_refused_in_one_line(url: str) -> None:
    with pytest.raises(ValueError, match="unknown scheme") as info:
        check_url(url)
    assert "\n" not in str(info.value) and "redis+sentinel://" in str(info.value)


def test_arq_gets_the_sentinels_and_the_master() -> None:
    settings = arq_redis_settings(SENTINEL_URL)
    assert settings.sentinel and settings.sentinel_master == "mymaster"
    assert settings.host == parse_sentinel_url(SENTINEL_URL).sentinels
    assert (settings.database, settings.password) == (2, "p@ss")


def test_api_pool_asks_the_sentinels() -> None:
    pool = make_redis(Settings(redis_url=SENTINEL_URL, _env_file=None), Keys("t")).connection_pool
    assert isinstance(pool, redis.asyncio.sentinel.SentinelConnectionPool)
    assert pool.service_name == "mymaster"
    assert pool.connection_kwargs["password"] == "p@ss" and pool.connection_kwargs["db"] == 2
    assert pool.connection_kwargs["socket_connect_timeout"] == 2.0  # the API's own options too
    hosts = [s.connection_pool.connection_kwargs["host"] for s in pool.sentinel_manager.sentinels]
    assert hosts == ["10.0.0.1", "10.0.0.2", "sent3"]


def test_sync_client_for_sentinel_and_plain_urls() -> None:
    client = sync_client(SENTINEL_URL, socket_timeout=0.5)
    assert isinstance(client.connection_pool, redis.sentinel.SentinelConnectionPool)
    plain = sync_client("redis://127.0.0.1:6390/3")
    assert plain.connection_pool.connection_kwargs["db"] == 3
    assert not isinstance(async_pool("redis://h/0"), redis.asyncio.sentinel.SentinelConnectionPool)


def test_logs_never_show_passwords() -> None:
    shown = safe_url("redis+sentinel://:pw@h:1/m?sentinel_password=s3&x=1")
    assert "pw" not in shown and "s3" not in shown and shown.endswith("?sentinel_password=***&x=1")


def test_per_job_keys_share_the_job_id_as_hash_tag() -> None:
    keys = Keys("ladle")
    job_id = "job-AbC_d-1"
    per_job = [keys.job(job_id), keys.payload(job_id), keys.stream(job_id), keys.cancelled(job_id)]
    assert all(key.endswith("{job-AbC_d-1}") for key in per_job)
    assert {Keys.job_id_of(key) for key in per_job} == {job_id}
    assert Keys.job_id_of(keys.job(job_id).encode()) == job_id
    assert keys.queue("m") == "ladle:queue:m"  # arq's queues keep their names


def test_cluster_streams_carry_a_slot_group_tag_spread_evenly() -> None:
    keys = Keys("ladle", stream_groups=CLUSTER_STREAM_GROUPS)
    job_ids = [f"job-{i:05d}" for i in range(3000)]
    groups = [shard_of(keys.stream(job_id), CLUSTER_STREAM_GROUPS) for job_id in job_ids]
    # the group is the job id's own slot range, so streams follow the job ids' spread
    assert groups == [stream_group(job_id, CLUSTER_STREAM_GROUPS) for job_id in job_ids]
    assert {Keys.job_id_of(keys.stream(job_id)) for job_id in job_ids} == set(job_ids)
    # redis-cli's even split over 3 masters gives each master 8 of the 24 groups
    tags = [group_tag(g, CLUSTER_STREAM_GROUPS) for g in range(CLUSTER_STREAM_GROUPS)]
    per_master = Counter(key_slot(tag.encode()) * 3 // 16384 for tag in tags)
    assert per_master == {0: 8, 1: 8, 2: 8}
    assert keys.job(job_ids[0]).endswith("{job-00000}")  # other per-job keys are unchanged


@pytest.mark.parametrize(
    ("env", "error"),
    [
        ({"relay_redis_cluster_url": "redis+sentinel://h:1/m"}, "redis://host:port"),
        (
            {"relay_redis_cluster_url": "redis://h:1", "relay_redis_urls": "redis://a:1"},
            "not both",
        ),
    ],
)
def test_relay_cluster_setting_is_checked(env: dict, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        Settings(_env_file=None, **env)


def test_relay_cluster_setting_picks_cluster_stream_keys() -> None:
    settings = Settings(_env_file=None, relay_redis_cluster_url="redis://127.0.0.1:7000")
    assert keys_for(settings).stream_groups == CLUSTER_STREAM_GROUPS
    assert keys_for(Settings(_env_file=None)).stream("job-1") == "ladle:stream:{job-1}"

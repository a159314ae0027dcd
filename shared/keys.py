"""Redis key names, in one place, all under the configured prefix."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot


@dataclass(frozen=True)
class Keys:
    prefix: str = "ladle"
    # Streams in a Redis Cluster: tagged by one of this many slot groups, not by job id (0).
    stream_groups: int = 0

    def queue(self, model: str, lane: str = "interactive") -> str:
        """A model's arq queue for one lane (a sorted set of job ids): interactive requests
        in `{p}:queue:{model}`, batch lines in `{p}:queue:{model}:batch`."""
        base = f"{self.prefix}:queue:{model}"
        return base if lane == "interactive" else f"{base}:{lane}"

    @property
    def models(self) -> str:
        """Hash: served model name -> its `ModelInfo` JSON (workers write it each heartbeat)."""
        return f"{self.prefix}:models"

    @property
    def batch_control_queue(self) -> str:
        """The arq queue of batch expansion and collection work (API processes run it)."""
        return f"{self.prefix}:batchctl"

    def file(self, file_id: str) -> str:
        """Hash: `meta` (FileRecord JSON) and `content` (the bytes)."""
        return f"{self.prefix}:file:{file_id}"

    def files(self, owner: str) -> str:
        """Sorted set: an owner's file ids by creation time."""
        return f"{self.prefix}:files:{owner}"

    def batch(self, batch_id: str) -> str:
        """String: the BatchRecord JSON."""
        return f"{self.prefix}:batch:{batch_id}"

    def batches(self, owner: str) -> str:
        """Sorted set: an owner's batch ids by creation time."""
        return f"{self.prefix}:batches:{owner}"

    def batch_results(self, batch_id: str) -> str:
        """Hash: line number -> `{"kind": "ok"|"err", "line": {...}}`, written once per line."""
        return f"{self.prefix}:batch:{batch_id}:results"

    def batch_counts(self, batch_id: str) -> str:
        """Hash: `ok` and `err` -> how many lines have that kind of result."""
        return f"{self.prefix}:batch:{batch_id}:counts"

    def batch_custom_ids(self, batch_id: str) -> str:
        """List: the input file's custom_ids in line order (the output needs them)."""
        return f"{self.prefix}:batch:{batch_id}:custom_ids"

    def batch_lock(self, batch_id: str) -> str:
        """Held (with a TTL) by whichever process is collecting the batch's results."""
        return f"{self.prefix}:batch:{batch_id}:lock"

    @property
    def workers(self) -> str:
        """Sorted set: worker id -> last heartbeat time."""
        return f"{self.prefix}:workers"

    @property
    def cancel_channel(self) -> str:
        """Pub/sub channel carrying job ids to abort."""
        return f"{self.prefix}:cancel"

    @property
    def wake_channel(self) -> str:
        """Pub/sub channel the API pings after enqueueing, so idle workers poll at once."""
        return f"{self.prefix}:wake"

    @property
    def supervisors(self) -> str:
        """Sorted set: `ladle up` supervisor id -> last update time."""
        return f"{self.prefix}:supervisors"

    def supervisor(self, supervisor_id: str) -> str:
        return f"{self.prefix}:supervisor:{supervisor_id}"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def prefixes(self, worker_id: str) -> str:
        """String, TTL: the worker's `PrefixFingerprint` JSON (what its prefix cache holds)."""
        return f"{self.prefix}:prefixes:{worker_id}"

    # Per-job keys carry the job id as a hash tag (`{id}`): a Redis Cluster puts all of one
    # job's keys in one slot, and a sharded relay picks a job's shard from the same id.
    def job(self, job_id: str) -> str:
        return f"{self.prefix}:job:{{{job_id}}}"

    def payload(self, job_id: str) -> str:
        return f"{self.prefix}:payload:{{{job_id}}}"

    def stream(self, job_id: str) -> str:
        """A job's event stream. In a Redis Cluster (`stream_groups`), a relay's XREAD may only
        name streams of one slot, so a stream carries its slot group's tag: `{p}:stream:{g..}:id`
        (the group whose slot range holds the job id's own slot)."""
        if not self.stream_groups:
            return f"{self.prefix}:stream:{{{job_id}}}"
        tag = group_tag(stream_group(job_id, self.stream_groups), self.stream_groups)
        return f"{self.prefix}:stream:{{{tag}}}:{job_id}"

    def routed(self, job_id: str) -> str:
        """String, expiring when the hold ends: the worker a queued job is held for (its
        prefix cache holds the prompt); other workers leave the job alone until then."""
        return f"{self.prefix}:routed:{{{job_id}}}"

    def cancelled(self, job_id: str) -> str:
        """Set when a job is cancelled, so a worker picking it up later skips it."""
        return f"{self.prefix}:cancelled:{{{job_id}}}"

    @staticmethod
    def job_id_of(key: str | bytes) -> str:
        """The job id in a per-job key: `ladle:job:{job-abc}` -> `job-abc`."""
        text = key.decode() if isinstance(key, bytes) else key
        return text.rsplit(":", 1)[-1].strip("{}")

    def key_jobs(self, api_key_id: str) -> str:
        """Set of a key's unfinished job ids (per-key concurrency limit)."""
        return f"{self.prefix}:keyjobs:{api_key_id}"

    def rate_requests(self, bucket: str) -> str:
        """Hash: Unix second -> requests admitted then (per-key requests per minute)."""
        return f"{self.prefix}:ratelimit:{bucket}:requests"

    def rate_tokens(self, bucket: str) -> str:
        """Hash: Unix second -> tokens reserved then (per-key tokens per minute)."""
        return f"{self.prefix}:ratelimit:{bucket}:tokens"

    def idempotency(self, scope: str, key_hash: str) -> str:
        """String: an `Idempotency-Key`'s claim (the object it created and the body's hash)."""
        return f"{self.prefix}:idem:{scope}:{key_hash}"

    def recent_jobs(self, api_key_id: str | None) -> str:
        """Sorted set: a key's newest job ids -> created time (the console's job list)."""
        return f"{self.prefix}:recent:{api_key_id or '-'}"


def stream_group(tag: str, num_groups: int) -> int:
    """Which of `num_groups` equal slot ranges a hash tag's slot falls in."""
    return key_slot(tag.encode()) * num_groups // REDIS_CLUSTER_HASH_SLOTS


@cache
def group_tag(group: int, num_groups: int) -> str:
    """The first tag `g<group>.<n>` whose slot lies in the middle half of the group's range, so
    an even split of the slots over masters gives each master its share of the groups."""
    width = REDIS_CLUSTER_HASH_SLOTS / num_groups
    low, high = (group + 0.25) * width, (group + 0.75) * width
    for n in range(100_000):
        tag = f"g{group}.{n}"
        if low <= key_slot(tag.encode()) < high:
            return tag
    raise ValueError(f"no tag found for slot group {group} of {num_groups}")

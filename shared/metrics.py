"""Every metric name, defined once; the API and the worker each build the group they expose.

Each group gets its own `CollectorRegistry`, so a process exposes only its own metrics and
tests can build several apps without "duplicated timeseries" errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    help: str
    kind: type
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    def create(self, registry: CollectorRegistry) -> Counter | Gauge | Histogram:
        kwargs: dict = {"registry": registry, "labelnames": self.labels}
        if self.buckets is not None:
            kwargs["buckets"] = self.buckets
        return self.kind(self.name, self.help, **kwargs)


# Counters are named without the `_total` suffix; prometheus_client appends it on exposition.
REQUESTS = MetricSpec("llm_requests", "HTTP requests", Counter, ("endpoint", "status"))
REQUEST_DURATION = MetricSpec(
    "llm_request_duration_seconds",
    "HTTP request duration",
    Histogram,
    ("endpoint",),
    LATENCY_BUCKETS,
)
ACTIVE_REQUESTS = MetricSpec("llm_active_requests", "HTTP requests in flight", Gauge)
RELAY_BUFFERED = MetricSpec(
    "llm_relay_buffered_events", "stream events read and not yet sent to clients", Gauge
)
RELAY_PAUSED = MetricSpec(
    "llm_relay_paused_readers", "streams paused because their client reads slowly", Gauge
)
PENDING_REQUESTS = MetricSpec("llm_pending_requests", "jobs in the queue (arq zset)", Gauge)
THROUGHPUT_TOKENS = MetricSpec("llm_throughput_tokens", "tokens processed", Counter, ("kind",))
PROMPT_TOKENS = MetricSpec(
    "llm_prompt_tokens", "prompt (or embedding input) tokens processed", Counter, ("endpoint",)
)
GENERATION_TOKENS = MetricSpec("llm_generation_tokens", "tokens generated", Counter)
TIME_TO_FIRST_TOKEN = MetricSpec(
    "llm_time_to_first_token_seconds", "time to first token", Histogram, (), LATENCY_BUCKETS
)
INTER_TOKEN_LATENCY = MetricSpec(
    "llm_inter_token_latency_seconds",
    "time between tokens",
    Histogram,
    (),
    TOKEN_LATENCY_BUCKETS,
)
QUEUE_TIME = MetricSpec(
    "llm_queue_time_seconds", "time a job waited in the queue", Histogram, (), LATENCY_BUCKETS
)
E2E_LATENCY = MetricSpec(
    "llm_e2e_request_latency_seconds",
    "job latency from enqueue to end",
    Histogram,
    (),
    LATENCY_BUCKETS,
)
LANE_QUEUE_DEPTH = MetricSpec(
    "llm_lane_queue_depth", "jobs waiting in a model's lane queue", Gauge, ("model", "lane")
)
LANE_WAIT = MetricSpec(
    "llm_lane_wait_seconds",
    "time a job waited before a worker started it, by lane",
    Histogram,
    ("lane",),
    LATENCY_BUCKETS + (900, 3600, 14400, 86400),
)
KV_CACHE_USAGE_BYTES = MetricSpec("llm_kv_cache_usage_bytes", "KV cache bytes in use", Gauge)
KV_CACHE_USAGE_RATIO = MetricSpec("llm_kv_cache_usage_ratio", "KV cache blocks used/total", Gauge)
BATCH_SIZE = MetricSpec("llm_batch_size", "sequences per engine step", Histogram, (), BATCH_BUCKETS)
NUM_RUNNING = MetricSpec("llm_num_requests_running", "sequences running", Gauge)
NUM_WAITING = MetricSpec("llm_num_requests_waiting", "sequences waiting", Gauge)
PREEMPTIONS = MetricSpec("llm_num_preemptions", "preempted sequences", Counter)
PREFIX_CACHE_QUERIES = MetricSpec("llm_prefix_cache_queries", "prompt tokens looked up", Counter)
PREFIX_CACHE_HITS = MetricSpec("llm_prefix_cache_hits", "prompt tokens found cached", Counter)
SPEC_DRAFT_TOKENS = MetricSpec(
    "llm_spec_decode_draft_tokens", "draft tokens proposed (n-gram speculation)", Counter
)
SPEC_ACCEPTED_TOKENS = MetricSpec(
    "llm_spec_decode_accepted_tokens", "draft tokens accepted (n-gram speculation)", Counter
)
SPEC_ACCEPTANCE_RATE = MetricSpec(
    "llm_spec_decode_acceptance_rate", "accepted / proposed draft tokens since start", Gauge
)
STEP_THREADS = MetricSpec(
    "llm_step_threads",
    "CPU threads each kind of engine step runs on now (chosen from measured step times)",
    Gauge,
    ("kind",),
)
STEP_THREAD_SWITCHES = MetricSpec(
    "llm_step_thread_switches", "times a kind of step moved to another thread count", Counter
)
TOKENS_PER_DECODE_STEP = MetricSpec(
    "llm_tokens_per_decode_step",
    "tokens a decoding sequence gains per engine step since start (1 without speculation)",
    Gauge,
)

SUPERVISOR_RESTARTS = MetricSpec(
    "llm_supervisor_restarts", "children ladle up restarted", Counter, ("child",)
)
SUPERVISOR_CHILD_UP = MetricSpec(
    "llm_supervisor_child_up", "1 while a supervised child runs, else 0", Gauge, ("child",)
)
SUPERVISOR_GIVEN_UP = MetricSpec(
    "llm_supervisor_child_given_up",
    "1 once a child crash-looped and is not restarted",
    Gauge,
    ("child",),
)


class ApiMetrics:
    """What an API process exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = REQUESTS.create(r)
        self.request_duration = REQUEST_DURATION.create(r)
        self.active_requests = ACTIVE_REQUESTS.create(r)
        self.pending_requests = PENDING_REQUESTS.create(r)
        self.relay_buffered = RELAY_BUFFERED.create(r)
        self.relay_paused = RELAY_PAUSED.create(r)
        self.time_to_first_token = TIME_TO_FIRST_TOKEN.create(r)
        self.e2e_latency = E2E_LATENCY.create(r)
        self.queue_time = QUEUE_TIME.create(r)
        self.prompt_tokens = PROMPT_TOKENS.create(r)
        self.generation_tokens = GENERATION_TOKENS.create(r)
        self.lane_queue_depth = LANE_QUEUE_DEPTH.create(r)
        self.lane_wait = LANE_WAIT.create(r)


class WorkerMetrics:
    """What a worker process exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.throughput_tokens = THROUGHPUT_TOKENS.create(r)
        self.prompt_tokens = PROMPT_TOKENS.create(r)
        self.generation_tokens = GENERATION_TOKENS.create(r)
        self.time_to_first_token = TIME_TO_FIRST_TOKEN.create(r)
        self.inter_token_latency = INTER_TOKEN_LATENCY.create(r)
        self.queue_time = QUEUE_TIME.create(r)
        self.e2e_latency = E2E_LATENCY.create(r)
        self.kv_cache_usage_bytes = KV_CACHE_USAGE_BYTES.create(r)
        self.kv_cache_usage_ratio = KV_CACHE_USAGE_RATIO.create(r)
        self.batch_size = BATCH_SIZE.create(r)
        self.num_running = NUM_RUNNING.create(r)
        self.num_waiting = NUM_WAITING.create(r)
        self.preemptions = PREEMPTIONS.create(r)
        self.prefix_cache_queries = PREFIX_CACHE_QUERIES.create(r)
        self.prefix_cache_hits = PREFIX_CACHE_HITS.create(r)
        self.spec_draft_tokens = SPEC_DRAFT_TOKENS.create(r)
        self.spec_accepted_tokens = SPEC_ACCEPTED_TOKENS.create(r)
        self.spec_acceptance_rate = SPEC_ACCEPTANCE_RATE.create(r)
        self.tokens_per_decode_step = TOKENS_PER_DECODE_STEP.create(r)
        self.step_threads = STEP_THREADS.create(r)
        self.step_thread_switches = STEP_THREAD_SWITCHES.create(r)


class SupervisorMetrics:
    """What `ladle up` exposes on LLM_SUPERVISOR_METRICS_PORT."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.restarts = SUPERVISOR_RESTARTS.create(r)
        self.child_up = SUPERVISOR_CHILD_UP.create(r)
        self.given_up = SUPERVISOR_GIVEN_UP.create(r)


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The Prometheus text exposition of a registry, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST

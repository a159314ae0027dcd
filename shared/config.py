"""One validated settings object for every process, read from LLM_* variables and `.env`."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


def _split_csv(value: object) -> object:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


class Settings(BaseSettings):
    """Everything configurable, with the seed's names where they apply (`LLM_` prefix)."""

    model_config = SettingsConfigDict(
        env_prefix="LLM_", env_file=".env", extra="ignore", protected_namespaces=()
    )

    # Redis and queue
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "ladle"

    # Model and engine (worker side)
    model_name: str = Field(
        DEFAULT_MODEL,
        description="default model name, a local HF directory, or a .gguf file",
    )
    served_model_name: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["auto", "none", "int8", "int4"] = Field(
        "auto",
        description="weight-only int8 (per channel) or int4 (groups of 32) projections, CPU; "
        "auto: as a GGUF holds them (4-bit in int4, 5-8-bit in int8) on a bf16 CPU, or in "
        "float32 chosen by LLM_DTYPE=auto on an AVX2 CPU, else none",
    )
    lm_head_quantization: Literal["auto", "none", "int8"] = Field(
        "auto",
        description="int8 lm_head (groups of 32, int8 activations, CPU native kernels: "
        "AVX512-VNNI, or AVX2 on float32), as a GGUF's Q8_0 head holds it: 10-23% faster for "
        "one client, equal at 16, 1.2 points lower top-1 agreement with float32 "
        "(docs/benchmarks.md); auto (default): where the projections are quantized",
    )
    max_batch_size: int = Field(64, ge=1, description="cap on running sequences")
    max_num_batched_tokens: int = Field(1024, ge=16, description="token budget per step")
    kv_cache_size_mb: int = Field(512, ge=1)
    kv_cache_dtype: Literal["auto", "model", "float16"] = Field(
        "auto",
        description="the KV cache's element type: model (the model's dtype), float16 (float32 "
        "models on the CPU's native row attention: half the bytes a step reads, as llama.cpp "
        "keeps it), auto (float16 where quantized weights run on float32 activations, else "
        "the model's)",
    )
    kv_cache_gpu_fraction: float | None = Field(None, gt=0, le=1)
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    max_model_len: int | None = Field(None, ge=16)
    num_threads: int | None = Field(None, ge=1, description="torch threads; default: cores")
    decode_threads: int | None = Field(
        None, ge=1, description="CPU threads for decode-only steps; default: measured per batch"
    )
    cuda_graphs: bool = Field(
        True, description="replay decode steps as CUDA graphs (CUDA only; off: eager)"
    )
    speculative_ngram: int = Field(
        0,
        ge=0,
        le=16,
        description="draft tokens per decode step from n-gram prompt lookup; 0: off",
    )
    speculative_ngram_size: int = Field(
        3,
        ge=1,
        le=8,
        description="longest n-gram matched for speculation (2 tokens at least, 1 if this is 1)",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="compile the forward with inductor (CPU): auto keeps it where measured faster",
    )
    malloc: str = Field(
        "auto",
        description="the worker's memory allocator: auto (jemalloc or tcmalloc where installed, "
        "preloaded at start), system (glibc malloc), or a library path",
    )
    linear_kernel: str = Field(
        "auto",
        description="matmul kernel: auto (timed per batch bucket at start), plain, prepacked, "
        "float32, native",
    )
    int4_kernel: Literal["auto", "avx512", "vnni", "amx"] = Field(
        "auto",
        description="int4 matmuls on bf16 activations: auto (the kernel timed fastest over 1-256 "
        "rows at install or first start), avx512 (vdpbf16ps on bf16 x), vnni (x quantized to "
        "int8 per group of 32, as llama.cpp does: AVX512-VNNI), amx (tiles, on a CPU with AMX)",
    )
    attention_kernel: Literal["auto", "avx512", "amx"] = Field(
        "auto",
        description="bf16 paged attention on a CPU with AMX: auto (the kernel timed faster "
        "over decode and prefill at install or first start), avx512 (vectors), amx (tiles: "
        "2-3x faster in prefill)",
    )
    native_kernels: bool = Field(
        True,
        description="Ladle's own C++ CPU kernels (bf16, int4 and float32 matmuls, paged "
        "attention, the fused small ops and layer stack), built with g++ at first start and "
        "cached; off: oneDNN matmuls and eager attention only",
    )
    deterministic: bool = Field(
        True,
        description="batch-invariant kernels (CPU, native kernels): a request's greedy or "
        "seeded tokens never depend on the rest of the batch, the prefix cache, chunking or "
        "threads; off: the fastest kernel per batch size",
    )
    cache_dir: str = Field(
        "~/.cache/ladle", description="converted GGUF models and other one-time work"
    )

    # Worker behaviour
    worker_id: str | None = None
    heartbeat_interval_s: float = 1.0
    worker_ttl_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    job_timeout_s: float = 600.0
    job_max_tries: int = Field(3, ge=1)
    engine_stall_s: float = Field(
        60.0, gt=0, description="a step running longer: worker unhealthy, its jobs handed back"
    )
    worker_max_queued: int = Field(4, ge=0, description="jobs taken beyond what can run now")
    worker_metrics_port: int = Field(9101, ge=0, description="worker /metrics port; 0: off")
    # Cache-aware routing (api/jobs/routing.py): a request goes to the worker that holds the
    # longest prefix of its prompt, which has it to itself for a short hold.
    prefix_routing: bool = Field(
        True, description="route a request to the worker whose prefix cache holds its prompt"
    )
    prefix_routing_hold_ms: int = Field(
        250, ge=0, description="how long a routed job waits for its worker before anyone takes it"
    )
    prefix_routing_max_imbalance: int = Field(
        3,
        ge=0,
        description="sequences a worker may have beyond the least busy and still be routed to",
    )
    # Token streams spread over these Redis instances (shared/relay_shards.py); empty: on
    # LLM_REDIS_URL with everything else.
    relay_redis_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated Redis URLs that hold the job streams, by job id hash",
    )
    relay_redis_cluster_url: str | None = Field(
        None,
        description="redis:// or rediss:// URL of any node of a Redis Cluster that holds the "
        "job streams (instead of LLM_RELAY_REDIS_URLS)",
    )
    # A batch-only worker group can scale to zero on its lane's queue (deploy/k8s/keda.yaml).
    worker_lanes: Annotated[list[Literal["interactive", "batch"]], NoDecode] = Field(
        default_factory=lambda: ["interactive", "batch"],
        min_length=1,
        description="the lanes of its model's queues a worker takes jobs from",
    )

    # Supervisor (`ladle up`): restarts children that exit unexpectedly
    restart_backoff_s: float = Field(
        1.0, gt=0, description="first restart delay; doubles per crash up to the max"
    )
    restart_backoff_max_s: float = Field(
        30.0, gt=0, description="longest restart delay; a child up this long starts again at 1"
    )
    crash_loop_max_crashes: int = Field(
        5, ge=1, description="crashes within the window after which a child is not restarted"
    )
    crash_loop_window_s: float = Field(300.0, gt=0)
    supervisor_metrics_port: int = Field(
        9100, ge=0, description="`ladle up`'s own /metrics port (restarts); 0: off"
    )

    # API behaviour
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_queue_depth: int = Field(1000, ge=1)
    max_request_body_bytes: int = Field(1_000_000, ge=1024)
    max_n: int = Field(8, ge=1)
    max_logit_bias: int = Field(300, ge=0)
    per_key_max_concurrent_jobs: int = Field(256, ge=1)
    api_keys_file: str | None = Field(
        None, description="TOML file of API keys and their limits; re-read when it changes"
    )
    rate_limit_requests_per_minute: int = Field(
        0, ge=0, description="default requests per minute per key; 0: no limit"
    )
    rate_limit_tokens_per_minute: int = Field(
        0, ge=0, description="default prompt + max_tokens per minute per key; 0: no limit"
    )
    embedding_token_ids: Literal["model", "cl100k_base"] = Field(
        "model",
        description="the vocabulary of token-id inputs to /v1/embeddings: the model's own, or "
        "OpenAI's cl100k_base (LangChain's default), decoded and tokenized again",
    )
    request_timeout_s: float = Field(600.0, gt=0)
    first_event_timeout_s: float = Field(60.0, gt=0)
    job_ttl_s: int = Field(3600, ge=1, description="how long finished jobs and streams stay")
    stream_maxlen: int = Field(10_000, ge=100)
    stream_buffer_events: int = Field(
        256, ge=2, description="events held per streaming client before reading pauses for it"
    )
    log_level: str = "INFO"

    # Priority, lanes and the Batch API
    priority_min: int = Field(0, description="lowest `priority` value a client may ask for")
    priority_max: int = Field(100, description="highest `priority` value a client may ask for")
    batch_reserved_seqs: int = Field(
        8, ge=0, description="sequence slots a worker never fills with batch lines"
    )
    batch_max_seqs: int = Field(16, ge=1, description="batch lines a worker runs at once")
    file_max_bytes: int = Field(50_000_000, ge=1024, description="largest upload to /v1/files")
    file_ttl_s: int = Field(30 * 86_400, ge=60, description="how long files stay in Redis")
    batch_max_lines: int = Field(50_000, ge=1, description="most lines in one batch input file")
    batch_poll_s: float = Field(1.0, gt=0, description="how often a batch's results are collected")
    batch_control: bool = Field(True, description="this API process runs batch expansion work")

    @model_validator(mode="after")
    def _check_relay_cluster(self) -> Settings:
        url = self.relay_redis_cluster_url
        if url and self.relay_redis_urls:
            raise ValueError("set LLM_RELAY_REDIS_URLS or LLM_RELAY_REDIS_CLUSTER_URL, not both")
        if url and urlsplit(url).scheme not in ("redis", "rediss"):
            raise ValueError("LLM_RELAY_REDIS_CLUSTER_URL is redis://host:port or rediss://...")
        return self

    @model_validator(mode="after")
    def _check_priority_range(self) -> Settings:
        if self.priority_min > self.priority_max:
            raise ValueError("priority_min must not be above priority_max")
        return self

    # Observability
    otel_endpoint: str | None = Field(
        None,
        validation_alias=AliasChoices("LLM_OTEL_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
        description="OTLP/HTTP base URL (http://host:4318) for traces; unset: tracing off",
    )

    @field_validator("api_keys", "cors_origins", "worker_lanes", "relay_redis_urls", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return _split_csv(value)

    @property
    def model_id(self) -> str:
        """The name clients use in the `model` field."""
        if self.served_model_name:
            return self.served_model_name
        name = self.model_name.rstrip("/").rsplit("/", 1)[-1]
        return name.removesuffix(".gguf")


OPENMP_SPIN_DEFAULTS = {"GOMP_SPINCOUNT": "30000", "KMP_BLOCKTIME": "1"}


def apply_openmp_defaults() -> None:
    """Idle OpenMP threads spin briefly, then sleep: about a millisecond, unless set.

    A decode step is ~120 matmuls on all threads with small single-threaded ops between them
    (20-300 us). A thread that sleeps at once (`OMP_WAIT_POLICY=PASSIVE`, the previous
    default) has to be woken by a futex for every matmul: one sequence's bf16 step of
    SmolLM2-135M on 2 threads took 50 ms that way against 24-26 ms with a bounded spin (idle
    AMD EPYC, docs/benchmarks.md "OpenMP wait policy"). libgomp's own default spins ~8 ms per
    gap, which steals the core the API and Redis need; 30,000 spins is ~1.5 ms there, enough
    to bridge the gaps inside a step. `KMP_BLOCKTIME` (ms) is the same knob for Intel's
    OpenMP, which some installs preload. Neither is set where the operator chose a policy
    (`OMP_WAIT_POLICY`, `GOMP_SPINCOUNT`, `KMP_BLOCKTIME`). OpenMP reads them once, when torch
    loads, so each entry point that runs the engine calls this first, before importing torch
    (`python -m worker`, `python -m worker.engine.cli`, the load tests).
    """
    if "OMP_WAIT_POLICY" in os.environ:
        return
    for name, value in OPENMP_SPIN_DEFAULTS.items():
        os.environ.setdefault(name, value)


ALLOCATOR_LIBRARIES = ("jemalloc", "tcmalloc_minimal", "tcmalloc")


def allocator_library(setting: str) -> str | None:
    """The allocator to preload for `LLM_MALLOC` = `setting` (None: glibc's malloc)."""
    if setting == "system":
        return None
    if setting != "auto":
        return setting
    import ctypes.util

    return next(filter(None, map(ctypes.util.find_library, ALLOCATOR_LIBRARIES)), None)


def preload_allocator() -> None:
    """Run this process on jemalloc/tcmalloc: re-exec it (same pid) with `LD_PRELOAD` set.

    A decode step allocates hundreds of short-lived tensors; glibc's malloc hands the larger
    ones back to the kernel and maps them again each step. With jemalloc preloaded one
    sequence's step of SmolLM2-135M took 24-27 ms against 26-27 ms, and 4 sequences' 26-29
    against 28-31 (interleaved runs, docs/benchmarks.md "Allocator"), as vLLM's CPU docs
    advise with tcmalloc. The loader reads `LD_PRELOAD` only at exec, hence the re-exec; it
    happens once (the library is then in `LD_PRELOAD`) and never where the library is
    missing or `LLM_MALLOC=system`. Call it first thing in an entry point.
    """
    try:
        env = allocator_env(os.environ, Settings().malloc)
    except ValueError:  # invalid settings: the command line reports them, on glibc malloc
        return
    if all(env.get(name) == os.environ.get(name) for name in ("LD_PRELOAD", "MALLOC_CONF")):
        return
    import sys

    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as exc:  # run on as we are: slower, not wrong
        print(f"could not re-exec with {env['LD_PRELOAD']} preloaded: {exc}", file=sys.stderr)


# jemalloc serves requests of 8 MiB and up (a 64-sequence step's logits) from an arena that
# hands freed pages back at once, so each step faulted them in again (docs/benchmarks.md)
JEMALLOC_CONF = "oversize_threshold:0"


def allocator_env(env: Mapping[str, str], setting: str) -> dict[str, str]:
    """`env` with the allocator for `LLM_MALLOC` = `setting` first in `LD_PRELOAD` (as it is
    where it is there already or none applies), and jemalloc's options unless the operator set
    `MALLOC_CONF`. A launcher that starts workers with it spares each its re-exec (a second
    interpreter start and settings import)."""
    library = allocator_library(setting)
    preloaded = env.get("LD_PRELOAD", "")
    out = dict(env)
    if library is None:
        return out
    if library not in preloaded.split(":"):
        out["LD_PRELOAD"] = ":".join(filter(None, [library, preloaded]))
    if "jemalloc" in Path(library).name:
        out.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    return out


def active_allocator() -> str:
    """What `preload_allocator` left in effect, for the start-up log."""
    preloaded = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if "alloc" in lib]
    if not preloaded:
        return "glibc malloc"
    conf = os.environ.get("MALLOC_CONF")
    return f"{preloaded[0]} (preloaded" + (f", MALLOC_CONF={conf})" if conf else ")")


def openmp_settings() -> dict[str, str | None]:
    """The OpenMP wait settings in effect (they change which thread count measures fastest)."""
    return {name: os.environ.get(name) for name in ("OMP_WAIT_POLICY", *OPENMP_SPIN_DEFAULTS)}


def apply_inductor_cache_dir(cache_dir: str) -> None:
    """Inductor's FX graph cache (generated C++ and .so files) under `cache_dir`, unless the
    operator set `TORCHINDUCTOR_CACHE_DIR`; inductor reads it when it first compiles."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir)


class ClientSettings(BaseSettings):
    """What client commands (`ladle batch`) read, as the examples do: `LADLE_BASE_URL`
    (default: this host's API port) and `LADLE_API_KEY`."""

    model_config = SettingsConfigDict(env_prefix="LADLE_", extra="ignore")

    base_url: str | None = None
    api_key: str | None = None


def settings_with(**flags: object) -> Settings:
    """Settings from LLM_* and .env, with the command-line flags that were given on top."""
    return Settings(**{key: value for key, value in flags.items() if value is not None})


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()

"""The embedding engine: whole inputs in, one vector (or one relevance score) out each.

No KV cache and no decode: a step takes waiting inputs in order (interactive before batch,
then priority, then arrival) until the token budget or the sequence cap is reached, runs
one forward over all of them packed back to back (`worker/layers/dense_attention.py`), and
finishes every one. So many short inputs share one forward, and an input is never split:
the budget is at least the longest input the model takes.

The same interface as `LLMEngine` where the worker's engine thread needs one:
`add_request`, `abort_request`, `step`, `has_unfinished_requests`, `request_ids`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from shared.contracts import JobPayload
from shared.errors import InvalidRequestError, check_input_length
from worker.engine.config import EngineConfig
from worker.engine.engine import EngineStats
from worker.engine.executor import configure_threads
from worker.engine.pooling import finish_vector, pool
from worker.engine.threads import ThreadChooser
from worker.layers.dense_attention import build_dense_batch, dense_batch
from worker.models.pooling_loader import LoadedPoolingModel, load_pooling_model

LANE_ORDER = {"interactive": 0, "batch": 1}


@dataclass
class EmbeddingRequest:
    """One input: its token ids (and segment ids for a cross-encoder's pair)."""

    request_id: str
    token_ids: list[int]
    token_type_ids: list[int] | None = None
    dimensions: int | None = None
    priority: int = 0
    lane: str = "interactive"
    index: int = 0  # the input's place in its job (a job of many inputs shares one id)
    arrival: int = 0

    @property
    def key(self) -> tuple[str, int]:
        return self.request_id, self.index

    @property
    def prompt_token_ids(self) -> list[int]:
        """The generator's name for a request's input ids (the worker counts usage by it)."""
        return self.token_ids


@dataclass
class EmbeddingOutput:
    """A finished input: `vector` (float32, 1-D) for an embedding model, else `score`."""

    request_id: str
    num_tokens: int
    vector: torch.Tensor | None = None
    score: float | None = None
    index: int = 0
    finished: bool = True


@dataclass
class EmbeddingStats:
    num_steps: int = 0
    num_inputs: int = 0
    num_tokens: int = 0
    last_step_inputs: int = 0
    last_step_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class PoolingExecutorInfo:
    """What the worker record says about how the model runs (the generator's executor has
    the same attributes): plain torch, no compiled forward or kernel plan."""

    device: str
    dtype: str
    compiled: bool = False
    deterministic: bool = False
    deterministic_reason: str = "embedding models run eager torch"
    kernels: dict[str, str] = field(default_factory=lambda: {"forward": "eager"})
    quantization: str = "none"


class EmbeddingRunner:
    """One forward over a packed batch of whole inputs, then pooling or the score head."""

    def __init__(self, loaded: LoadedPoolingModel) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = loaded.device

    @torch.inference_mode()
    def run(self, requests: list[EmbeddingRequest]) -> list[EmbeddingOutput]:
        seq_lens = [len(r.token_ids) for r in requests]
        hidden = self._forward(requests, seq_lens)
        if self.loaded.task == "score":
            scores = self._scores(hidden, seq_lens)
            return [
                EmbeddingOutput(r.request_id, n, score=s, index=r.index)
                for r, n, s in zip(requests, seq_lens, scores, strict=True)
            ]
        pooled = pool(hidden, seq_lens, self.loaded.pooling.mode).cpu()
        normalize = self.loaded.pooling.normalize
        return [
            EmbeddingOutput(
                r.request_id, n, vector=finish_vector(v, normalize, r.dimensions), index=r.index
            )
            for r, n, v in zip(requests, seq_lens, pooled, strict=True)
        ]

    def _forward(self, requests: list[EmbeddingRequest], seq_lens: list[int]) -> torch.Tensor:
        device = self.device
        ids = torch.tensor([t for r in requests for t in r.token_ids], device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in seq_lens])
        types = None
        if any(r.token_type_ids for r in requests):
            types = torch.tensor(
                [t for r in requests for t in (r.token_type_ids or [0] * len(r.token_ids))],
                device=device,
            )
        batch = build_dense_batch(seq_lens, self.model.is_causal, device)
        with dense_batch(batch):
            return self.model(ids, positions, types)

    def _scores(self, hidden: torch.Tensor, seq_lens: list[int]) -> list[float]:
        firsts = torch.cumsum(torch.tensor([0, *seq_lens[:-1]], device=hidden.device), 0)
        logits = self.model.classify(hidden[firsts]).float()[:, 0]
        if self.loaded.score_activation == "sigmoid":
            logits = torch.sigmoid(logits)
        return logits.cpu().tolist()


class EmbeddingEngine:
    """Queues inputs and runs them a token-budgeted batch per step (one thread owns it)."""

    def __init__(
        self,
        loaded: LoadedPoolingModel,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        threads: ThreadChooser | None = None,
    ) -> None:
        self.loaded = loaded
        self.runner = EmbeddingRunner(loaded)
        self.max_model_len = loaded.max_model_len
        self.vocab_size = int(loaded.hf_config.vocab_size)
        # an input is never split, so the budget holds at least the longest one
        self.max_num_batched_tokens = max(max_num_batched_tokens, self.max_model_len)
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[tuple[str, int], EmbeddingRequest] = {}
        self.counters = EmbeddingStats()
        self._arrivals = itertools.count()
        self.executor = PoolingExecutorInfo(
            str(loaded.device), str(loaded.dtype).removeprefix("torch.")
        )
        # None: every step on the threads torch has (the offline Embedder, a GPU)
        self.threads = threads

    def model_info(self) -> dict[str, Any]:
        """The worker record's fields for this model: its task and vector sizes."""
        pooling = self.loaded.pooling
        matryoshka = pooling.matryoshka_dimensions
        return {
            "task": self.loaded.task,
            "embedding_size": self.loaded.hidden_size if self.loaded.task == "embed" else 0,
            "matryoshka_dimensions": None if matryoshka is None else list(matryoshka),
        }

    def prepare(self, request: EmbeddingRequest, param: str = "input") -> EmbeddingRequest:
        """Validate an input's length, ids and `dimensions` (InvalidRequestError if bad)."""
        if not request.token_ids:
            raise InvalidRequestError("input must not be empty", param=param)
        check_input_length(len(request.token_ids), self.max_model_len, param)
        if any(not 0 <= t < self.vocab_size for t in request.token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {self.vocab_size})", param=param)
        check_dimensions(self.loaded, request.dimensions)
        return request

    def prepare_job(self, payload: JobPayload, request_id: str) -> list[EmbeddingRequest]:
        """One validated input per prompt of an embedding or scoring job, under one id."""
        spec = payload.pooling
        types = spec.token_type_batch if spec is not None else None
        requests = [
            EmbeddingRequest(
                request_id,
                ids,
                token_type_ids=types[i] if types else None,
                dimensions=spec.dimensions if spec is not None else None,
                priority=payload.priority,
                lane=payload.lane,
                index=i,
            )
            for i, ids in enumerate(payload.prompts)
        ]
        return [self.prepare(r, payload.prompt_param) for r in requests]

    def add_request(self, request: EmbeddingRequest) -> None:
        if request.key in self.waiting:
            raise ValueError(f"input {request.key!r} already added")
        self.prepare(request)
        request.arrival = next(self._arrivals)
        self.waiting[request.key] = request

    def abort_request(self, request_id: str) -> None:
        """Drop every input of `request_id` not yet run."""
        for key in [k for k in self.waiting if k[0] == request_id]:
            del self.waiting[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def request_ids(self) -> list[str]:
        return list(dict.fromkeys(k[0] for k in self.waiting))

    def schedule(self) -> list[EmbeddingRequest]:
        """The next step's inputs: in order, while the budget and the sequence cap allow."""
        order = sorted(self.waiting.values(), key=_order_key)
        chosen, num_tokens = [], 0
        for request in order:
            size = len(request.token_ids)
            if chosen and (
                num_tokens + size > self.max_num_batched_tokens or len(chosen) == self.max_num_seqs
            ):
                break
            chosen.append(request)
            num_tokens += size
        return chosen

    def step(self) -> list[EmbeddingOutput]:
        chosen = self.schedule()
        if not chosen:
            return []
        outputs = self._run(chosen)
        for request in chosen:
            del self.waiting[request.key]
        self.counters.num_steps += 1
        self.counters.num_inputs += len(chosen)
        self.counters.num_tokens += sum(o.num_tokens for o in outputs)
        self.counters.last_step_inputs = len(chosen)
        self.counters.last_step_tokens = sum(o.num_tokens for o in outputs)
        return outputs

    def _run(self, chosen: list[EmbeddingRequest]) -> list[EmbeddingOutput]:
        """One forward on the thread count the chooser picks for a step of this size: on
        cores another process is using, a 2-thread step waits at every OpenMP barrier for a
        thread that is not running (docs/benchmarks.md, "Embeddings at batch 1")."""
        if self.threads is None:
            return self.runner.run(chosen)
        num_tokens = sum(len(r.token_ids) for r in chosen)
        kind = f"tokens<={token_bucket(num_tokens)}"
        threads = self.threads.pick(kind)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        started = time.perf_counter()
        outputs = self.runner.run(chosen)
        # scaled to a full bucket: steps of one kind differ in size up to 4x
        seconds = (time.perf_counter() - started) * token_bucket(num_tokens) / num_tokens
        self.threads.record(kind, threads, seconds)
        return outputs

    def stats(self) -> EngineStats:
        """The generator's stats shape, which the worker's heartbeat and metrics read: no KV
        cache, nothing running between steps."""
        return EngineStats(
            num_running=0,
            num_waiting=len(self.request_ids()),  # jobs, as admission counts them
            num_blocks_used=0,
            num_blocks_total=0,
            block_size=0,
            kv_bytes_per_block=0,
            num_preemptions_total=0,
            num_prefix_query_tokens=0,
            num_prefix_hit_tokens=0,
            last_batch_size=self.counters.last_step_inputs,
            last_num_batched_tokens=self.counters.last_step_tokens,
        )


def check_dimensions(loaded: LoadedPoolingModel, dimensions: int | None) -> None:
    """`dimensions` is only for embedding models trained for truncation (Matryoshka)."""
    if dimensions is None:
        return
    allowed = loaded.pooling.matryoshka_dimensions
    if loaded.task != "embed" or allowed is None:
        raise InvalidRequestError(
            "this model does not support truncating its embeddings ('dimensions')",
            param="dimensions",
        )
    if not 1 <= dimensions <= loaded.hidden_size or (allowed and dimensions not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {loaded.hidden_size}"
        raise InvalidRequestError(f"dimensions must be one of: {sizes}", param="dimensions")


def token_bucket(num_tokens: int) -> int:
    """Steps are compared with steps of like size: 32, 128, 512, ... tokens (a power of 4)."""
    bucket = 32
    while bucket < num_tokens:
        bucket *= 4
    return bucket


def _order_key(request: EmbeddingRequest) -> tuple[int, int, int]:
    return LANE_ORDER.get(request.lane, 1), request.priority, request.arrival


def build_embedding_engine(config: EngineConfig) -> EmbeddingEngine:
    """The worker's engine for an embedding model or cross-encoder, from its settings: on CPU
    each size of step runs on 1 thread or all of them, whichever its recent steps ran faster."""
    configure_threads(config.num_threads)
    num_threads = torch.get_num_threads()
    loaded = load_pooling_model(
        config.model,
        dtype=config.dtype,
        device=config.device,
        cache_dir=config.cache_dir,
        max_model_len=config.max_model_len,
    )
    threads = None
    if loaded.device.type == "cpu" and num_threads > 1:
        threads = ThreadChooser([1, num_threads], lambda _kind: num_threads)
    return EmbeddingEngine(
        loaded, config.max_num_batched_tokens, config.max_num_seqs, threads=threads
    )

"""The engine: schedule -> execute -> update, one step at a time, on one thread.

Not thread-safe: one thread owns it (`EngineThread` in `worker/engine_thread.py`), and others
read the `stats()` snapshot that thread publishes after each step. `prepare()` only reads the
tokenizer and configuration and may run elsewhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from shared.errors import InvalidRequestError, check_context_length
from shared.grammar import GrammarError
from shared.tokenizer import Tokenizer, load_tokenizer
from worker.engine.config import EngineConfig
from worker.engine.core.block_manager import BlockManager
from worker.engine.core.hybrid_blocks import HybridBlockManager
from worker.engine.core.outputs import SampledToken
from worker.engine.core.request import Request, RequestStatus
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.core.scheduler import Scheduler, SchedulerConfig
from worker.engine.detokenizer import IncrementalDetokenizer
from worker.engine.executor import Executor, build_executor
from worker.engine.grammar_matcher import GrammarCompiler, GrammarMatcher
from worker.engine.inputs import tokenize_prompt

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """A validated request: token ids and final parameters, ready for `add_request`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    priority: int = 0
    lane: str = "interactive"
    # An llguidance grammar (shared/grammar.py) every output token must follow, or None.
    grammar: str | None = None
    # Choice index of the first of its n sequences (a request of several prompts adds one
    # PreparedRequest per prompt under the same id, the k-th at k * n).
    first_index: int = 0


@dataclass
class SequenceOutput:
    """One step's news for one choice of one request."""

    request_id: str
    index: int
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[SampledToken] | None
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    first_scheduled_time: float | None = None  # time.monotonic() of its first step

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    block_size: int
    kv_bytes_per_block: int
    num_preemptions_total: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int
    last_batch_size: int = 0
    last_num_batched_tokens: int = 0
    # Speculative decoding (n-gram), counted since start; see SpeculationStats.
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_tokens: int = 0
    # CPU threads per kind of step as chosen now, and how often a choice changed (threads.py)
    step_threads: dict[str, int] = field(default_factory=dict)
    num_thread_switches: int = 0
    # The prefix cache's block hashes (the same tuple until it changes): the worker's fingerprint
    cached_block_hashes: tuple[bytes, ...] = ()

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts kept / drafts proposed (0.0 before the first draft)."""
        drafted = self.num_spec_draft_tokens
        return self.num_spec_accepted_tokens / drafted if drafted else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        """Tokens a decoding sequence gained per step (1.0 without speculation)."""
        steps = self.num_decode_steps
        return self.num_decode_tokens / steps if steps else 0.0


@dataclass
class _Sequence:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer


@dataclass
class _StepInfo:
    batch_size: int = 0
    num_batched_tokens: int = 0
    started_at: float = field(default_factory=time.perf_counter)


class LLMEngine:
    """Continuous-batching engine over our paged-KV model runner."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.config = config
        self.executor = executor or build_executor(config)
        self.tokenizer = tokenizer or load_tokenizer(config.model, config.cache_dir)
        # A sequence must fit the cache on its own, or it could never finish.
        self.max_model_len = min(
            self.executor.max_model_len, self.executor.num_blocks * config.block_size
        )
        self.eos_token_ids = frozenset(self.executor.eos_token_ids) | frozenset(
            self.tokenizer.eos_token_ids
        )
        self.block_manager = _block_manager(self.executor, config)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                num_speculative_tokens=config.speculative_ngram,
                speculative_max_ngram=config.speculative_ngram_size,
            ),
            self.block_manager,
        )
        self.grammars = GrammarCompiler(
            self.tokenizer.hf, self.executor.vocab_size, sorted(self.eos_token_ids)
        )
        self._sequences: dict[str, _Sequence] = {}
        self._children: dict[str, list[str]] = {}
        self._last_step = _StepInfo()

    # ---- input -------------------------------------------------------------------------

    def tokenize(
        self,
        prompt: str | list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Prompt text, token ids or chat messages -> token ids (chat template applied)."""
        return tokenize_prompt(
            self.tokenizer, prompt, messages, add_generation_prompt, chat_template_kwargs
        )

    def prepare(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        param_name: str = "prompt",
        lane: str = "interactive",
        grammar: str | None = None,
    ) -> PreparedRequest:
        """Validate lengths, token ids and the grammar; resolve the default max_tokens.

        With a `grammar` the output follows it; reaching max_tokens first ends it unfinished
        (finish_reason "length"), the grammar's end ends it with "stop".
        """
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError("prompt must not be empty", param=param_name)
        vocab_size = self.executor.vocab_size
        if any(not 0 <= t < vocab_size for t in prompt_token_ids):
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {vocab_size})", param=param_name
            )
        if any(not 0 <= t < vocab_size for t in params.logit_bias):
            raise InvalidRequestError(
                f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias"
            )
        max_tokens = check_context_length(
            num_prompt, params.max_tokens, self.max_model_len, param_name
        )
        if grammar is not None:
            self._grammar_matcher(grammar)  # compiled (and cached) now: its errors are 400s
        return PreparedRequest(
            request_id, list(prompt_token_ids), params, max_tokens, priority, lane, grammar
        )

    def add_request(self, prepared: PreparedRequest) -> None:
        """Queue a prepared request; `n > 1` becomes n sequences sharing the prompt."""
        params = prepared.params
        child_ids = []
        for j in range(params.n):
            index = prepared.first_index + j
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = _with_seed(params, params.seed + j)
            child_id = f"{prepared.request_id}#{index}"
            request = Request(
                request_id=child_id,
                prompt_token_ids=prepared.prompt_token_ids,
                sampling_params=child_params,
                max_tokens=prepared.max_tokens,
                eos_token_ids=self.eos_token_ids,
                priority=prepared.priority,
                lane=prepared.lane,
            )
            if prepared.grammar is not None:
                request.grammar = self._grammar_matcher(prepared.grammar)
            self.scheduler.add_request(request)
            detok = IncrementalDetokenizer(self.tokenizer, prepared.prompt_token_ids, child_params)
            self._sequences[child_id] = _Sequence(prepared.request_id, index, detok)
            child_ids.append(child_id)
        self._children.setdefault(prepared.request_id, []).extend(child_ids)

    def abort_request(self, request_id: str) -> bool:
        """Abort every sequence of a request now; its KV blocks are free on return."""
        child_ids = self._children.pop(request_id, [])
        self.scheduler.abort_requests(child_ids)
        self._forget(child_ids)
        return bool(child_ids)

    # ---- the step ----------------------------------------------------------------------

    def step(self) -> list[SequenceOutput]:
        """Run one engine iteration and return what each touched sequence produced."""
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty:
            return []
        runner_output = self.executor.execute(scheduler_output)
        updated = self.scheduler.update_from_output(scheduler_output, runner_output)
        outputs = [self._process(req, runner_output.sampled[req.request_id]) for req in updated]
        self._last_step = _StepInfo(
            len(scheduler_output.chunks), scheduler_output.num_batched_tokens, started
        )
        return outputs

    def request_ids(self) -> list[str]:
        """Ids of the requests the engine holds (each may have several sequences)."""
        return list(self._children)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> EngineStats:
        bm = self.block_manager
        spec = self.scheduler.spec_stats
        threads = getattr(self.executor, "threads", None)  # CPU executors only
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_blocks_used=bm.num_used_blocks,
            num_blocks_total=bm.num_blocks,
            block_size=bm.block_size,
            kv_bytes_per_block=self.executor.kv_bytes_per_block,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            num_prefix_query_tokens=bm.num_prefix_query_tokens,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            last_batch_size=self._last_step.batch_size,
            last_num_batched_tokens=self._last_step.num_batched_tokens,
            num_spec_draft_tokens=spec.num_draft_tokens,
            num_spec_accepted_tokens=spec.num_accepted_tokens,
            num_decode_steps=spec.num_decode_steps,
            num_decode_tokens=spec.num_decode_tokens,
            step_threads=threads.choices() if threads else {},
            num_thread_switches=threads.num_switches if threads else 0,
            cached_block_hashes=bm.cached_hashes(),
        )

    # ---- internals ---------------------------------------------------------------------

    def _process(self, request: Request, sampled: list[SampledToken]) -> SequenceOutput:
        seq = self._sequences[request.request_id]
        params = request.sampling_params
        kept, text, finish = self._take_tokens(request, sampled, seq.detokenizer)
        if finish is not None:
            if seq.detokenizer.stop_reason is None:
                text += seq.detokenizer.flush()
            status = (
                RequestStatus.FINISHED_STOPPED
                if finish == "stop"
                else RequestStatus.FINISHED_LENGTH
            )
            self.scheduler.finish_request(request.request_id, status)
            self._forget([request.request_id])
            self._drop_parent_if_done(seq.parent_id)
        return SequenceOutput(
            request_id=seq.parent_id,
            index=seq.index,
            new_text=text,
            new_token_ids=[s.token_id for s in kept],
            new_logprobs=kept if params.logprobs is not None else None,
            finish_reason=finish,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            first_scheduled_time=request.first_scheduled_time,
        )

    def _take_tokens(
        self,
        request: Request,
        sampled: list[SampledToken],
        detokenizer: IncrementalDetokenizer,
    ) -> tuple[list[SampledToken], str, str | None]:
        """Detokenize and stop-check the step's tokens (several with speculation) in order.

        Tokens after the first that finishes the sequence are dropped from the request too.
        Returns the tokens kept, their text and the finish reason.
        """
        params = request.sampling_params
        num_before = request.num_output_tokens - len(sampled)
        text, finish, kept = "", None, []
        for sample in sampled:
            kept.append(sample)
            token_id = sample.token_id
            is_stop_token = token_id in params.stop_token_ids or (
                token_id in request.eos_token_ids and not params.ignore_eos
            )
            if request.grammar is not None and not is_stop_token:
                if not request.grammar.accept(token_id):
                    logger.error("token %d broke the grammar: %s", token_id, request.grammar.error)
            if not is_stop_token:
                text += detokenizer.append(token_id)
            finish = self._finish_reason(
                request, num_before + len(kept), is_stop_token, detokenizer
            )
            if finish is not None:
                break
        del request.output_token_ids[num_before + len(kept) :]
        return kept, text, finish

    def _finish_reason(
        self,
        request: Request,
        num_output_tokens: int,
        is_stop_token: bool,
        detokenizer: IncrementalDetokenizer,
    ) -> str | None:
        if is_stop_token or detokenizer.stop_reason is not None:
            return "stop"
        if request.grammar is not None and request.grammar.is_finished:
            return "stop"  # the grammar is complete and allows nothing more
        if num_output_tokens >= request.max_tokens:
            return "length"
        if request.num_prompt_tokens + num_output_tokens >= self.max_model_len:
            return "length"
        return None

    def _grammar_matcher(self, grammar: str) -> GrammarMatcher:
        try:
            return self.grammars.matcher(grammar)
        except GrammarError as exc:
            raise InvalidRequestError(
                f"the structured output spec does not compile: {exc}",
                param="response_format",
                code="invalid_schema",
            ) from exc

    def _forget(self, child_ids: list[str]) -> None:
        for child_id in child_ids:
            self._sequences.pop(child_id, None)
        self.executor.release(child_ids)

    def _drop_parent_if_done(self, parent_id: str) -> None:
        child_ids = self._children.get(parent_id, [])
        if all(child_id not in self._sequences for child_id in child_ids):
            self._children.pop(parent_id, None)


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _block_manager(executor: Executor, config: EngineConfig) -> BlockManager | HybridBlockManager:
    """One pool, or two where the executor gave sliding-window layers their own."""
    num_local = getattr(executor, "num_local_blocks", 0)
    window = getattr(executor, "sliding_window", None)
    if num_local and window:
        return HybridBlockManager(
            executor.num_blocks,
            num_local,
            config.block_size,
            window,
            config.enable_prefix_caching,
        )
    return BlockManager(executor.num_blocks, config.block_size, config.enable_prefix_caching)

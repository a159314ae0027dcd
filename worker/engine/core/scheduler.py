"""Continuous-batching scheduler (vLLM v1 style; pure bookkeeping, never imports torch).

One rule: each step a request is given `min(num_tokens - num_computed_tokens, budget)`
tokens. That covers chunked prefill, prefix-cache hits, decode and recompute after
preemption. A decoding request may carry draft tokens (n-gram speculation): its known
tokens then grow by the drafts for that step, and after verification `num_computed_tokens`
is set back to what was kept and the blocks past it are freed. Running requests go first,
in (lane, priority, arrival) order, interactive requests before batch lines; when blocks
run out the worst running request (a batch line while any runs) is preempted by
recompute. Waiting requests are then admitted in strict (lane, priority, arrival) order
while the token budget and `max_num_seqs` allow. While an interactive request's prompt is
not yet computed, batch lines sit the step out (they keep their KV blocks).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable
from dataclasses import dataclass

from worker.engine.core.block_manager import BlockManager, cdiv
from worker.engine.core.hybrid_blocks import HybridBlockManager
from worker.engine.core.ngram import NgramProposer, can_speculate
from worker.engine.core.outputs import ModelRunnerOutput, ScheduledChunk, SchedulerOutput
from worker.engine.core.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    """The engine's limits (from `EngineConfig`, itself from `Settings`: no defaults here)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Draft tokens per decode step from n-gram prompt lookup (0: no speculation).
    num_speculative_tokens: int
    speculative_max_ngram: int
    enable_chunked_prefill: bool = True


@dataclass
class SpeculationStats:
    """Counters since start: drafts proposed and kept, decode steps and the tokens they gave."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_steps: int = 0
    num_decode_tokens: int = 0


class Scheduler:
    """Decides which tokens of which requests each engine step computes."""

    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager | HybridBlockManager
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._seq: dict[str, int] = {}
        self._next_seq = 0
        self._finished_ids: list[str] = []
        self._hold_batch = False
        self.proposer: NgramProposer | None = None
        if config.num_speculative_tokens > 0:
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.speculative_max_ngram
            )
        self.spec_stats = SpeculationStats()

    # ---- queue management ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request. Raises ValueError if its prompt can never fit in the KV cache."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens == 0:
            raise ValueError("prompt must contain at least one token")
        if request.num_prompt_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than the model's "
                f"maximum context length of {self.config.max_model_len} tokens"
            )
        if (
            not self.config.enable_chunked_prefill
            and request.num_prompt_tokens > self.config.max_num_batched_tokens
        ):
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than the "
                f"{self.config.max_num_batched_tokens} tokens a step may batch without "
                "chunked prefill"
            )
        bm = self.block_manager
        num_blocks_needed = cdiv(request.num_prompt_tokens + 1, bm.block_size)
        if num_blocks_needed > bm.num_blocks:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens and needs {num_blocks_needed} "
                f"KV cache blocks, but the whole cache holds only {bm.num_blocks} blocks of "
                f"{bm.block_size} tokens"
            )
        self._seq[request.request_id] = self._next_seq
        self._next_seq += 1
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self._order_key)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort requests in any state; their blocks are freed at once. Unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
                aborted.append(request)
        return aborted

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Mark a request finished with `status`, free its blocks and forget it."""
        if not status.is_finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        request.status = status
        self._remove(self.running, request)
        self._remove(self.waiting, request)
        self.block_manager.free(request_id)
        if self.proposer is not None:
            self.proposer.release(request_id)
        self._seq.pop(request_id, None)
        self._finished_ids.append(request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks: running requests first, then admissions from waiting.

        `finished_request_ids` lists requests finished since the previous step (so the
        runner can drop per-request state), including any the scheduler itself stopped with
        FINISHED_LENGTH because their tokens outgrew the whole KV cache.
        """
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted_ids: list[str] = []
        self._hold_batch = self._interactive_prompt_pending()
        budget = self._schedule_running(budget, chunks, preempted_ids)
        if not preempted_ids:
            self._schedule_waiting(budget, chunks, preempted_ids)
        decodes = [chunk for chunk in chunks if chunk.is_decode]
        prefills = [chunk for chunk in chunks if not chunk.is_decode]
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            chunks=decodes + prefills,
            preempted_request_ids=preempted_ids,
            finished_request_ids=finished_ids,
        )

    def _interactive_prompt_pending(self) -> bool:
        """An interactive request still has prompt tokens to compute (its first token is not
        out yet): batch lines sit this step out, so it runs in a step of interactive
        sequences only and its time to first token does not grow with the batch lane."""
        if self.waiting and self.waiting[0].lane != "batch":
            return True
        return any(
            r.lane != "batch" and r.num_computed_tokens < r.num_prompt_tokens for r in self.running
        )

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted_ids: list[str]
    ) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._hold_batch and request.lane == "batch":
                break  # the running list is sorted: only batch lines are left
            if self._exceeds_cache(request):
                self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                continue
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0:
                index += 1
                continue
            draft_token_ids = self._propose(request, num_new, budget)
            # Drafts only where their blocks are free: never preempt anyone for a guess.
            if draft_token_ids and self.block_manager.allocate_slots(
                request, num_new + len(draft_token_ids)
            ):
                chunks.append(self._make_chunk(request, num_new, draft_token_ids))
                budget -= num_new + len(draft_token_ids)
                index += 1
                continue
            while not self.block_manager.allocate_slots(request, num_new):
                # The running list is sorted, so the victim is never one already scheduled.
                victim = self.running[-1]
                self._preempt(victim)
                preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                chunks.append(self._make_chunk(request, num_new))
                budget -= num_new
                index += 1
        return budget

    def _schedule_waiting(
        self, budget: int, chunks: list[ScheduledChunk], preempted_ids: list[str]
    ) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._hold_batch and request.lane == "batch":
                break
            if self._exceeds_cache(request):
                self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                continue
            num_cached = bm.allocate_prefix(request)
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            num_new = self._num_new_tokens(request, budget)
            if num_new == 0 or not bm.allocate_slots(request, num_new):
                bm.free(request.request_id)
                request.num_computed_tokens = 0
                if num_new and self._hold_batch and self._preempt_batch_tail(preempted_ids):
                    continue  # a batch line gave its blocks to the interactive request
                break  # strict FCFS: nobody overtakes the head of the queue
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._order_key)
            chunks.append(self._make_chunk(request, num_new))
            budget -= num_new

    def _preempt_batch_tail(self, preempted_ids: list[str]) -> bool:
        """Preempt the last running batch line (held, so not in this step), if any."""
        if not self.running or self.running[-1].lane != "batch":
            return False
        victim = self.running[-1]
        self._preempt(victim)
        preempted_ids.append(victim.request_id)
        return True

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to compute this step; 0 when an unchunked prefill does not fit whole.

        Without chunked prefill, a recompute longer than a whole step's budget (a preempted
        request that has generated a lot) is still chunked, or it could never run again.
        """
        num_remaining = request.num_tokens - request.num_computed_tokens
        num_new = min(num_remaining, budget)
        is_unsplittable = num_remaining <= self.config.max_num_batched_tokens
        if num_new < num_remaining and is_unsplittable and not self.config.enable_chunked_prefill:
            return 0
        return num_new

    def _propose(self, request: Request, num_new: int, budget: int) -> list[int]:
        """Draft tokens for a decoding request, no more than it may still generate."""
        if self.proposer is None or num_new != 1 or not can_speculate(request):
            return []
        if request.num_tokens - request.num_computed_tokens != 1:
            return []
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.config.max_model_len - request.num_tokens - 1,
        )
        return self.proposer.propose(request, room)

    def _make_chunk(
        self, request: Request, num_new: int, draft_token_ids: list[int] | None = None
    ) -> ScheduledChunk:
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        start = request.num_computed_tokens
        draft_token_ids = draft_token_ids or []
        return ScheduledChunk(
            request=request,
            start_position=start,
            num_tokens=num_new + len(draft_token_ids),
            block_ids=self.block_manager.get_block_ids(request.request_id),
            local_block_ids=self.block_manager.get_local_block_ids(request.request_id),
            is_sampling=start + num_new == request.num_tokens,
            draft_token_ids=draft_token_ids,
        )

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free the blocks and requeue in (priority, arrival) order."""
        self._remove(self.running, request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        bisect.insort(self.waiting, request, key=self._order_key)

    def _exceeds_cache(self, request: Request) -> bool:
        """True when the request's known tokens can never all be in the cache at once."""
        bm = self.block_manager
        return cdiv(request.num_tokens, bm.block_size) > bm.num_blocks

    # ---- results -------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Advance computed counts, append sampled tokens, cache newly full blocks.

        Rejected drafts are rolled back: their positions do not count as computed, their
        blocks are freed, and no block holding them is ever hashed. Returns the requests that
        received tokens, in chunk order. Stop conditions are the engine's job (it calls
        `finish_request`, and drops tokens after a stop).
        """
        updated: list[Request] = []
        for chunk in scheduler_output.chunks:
            request = chunk.request
            if request.is_finished or self.requests.get(request.request_id) is not request:
                continue
            if request.status is not RequestStatus.RUNNING:
                continue
            sampled = runner_output.sampled.get(request.request_id) if chunk.is_sampling else None
            num_kept = len(sampled) - 1 if sampled else 0
            num_rejected = len(chunk.draft_token_ids) - num_kept
            request.num_computed_tokens += chunk.num_tokens - num_rejected
            if sampled:
                request.output_token_ids.extend(s.token_id for s in sampled)
                self._count_decode(chunk, len(sampled))
            if chunk.draft_token_ids:
                self.block_manager.free_tail(request.request_id, request.num_tokens)
            self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
            if sampled:
                if request.first_token_time is None:
                    request.first_token_time = time.monotonic()
                updated.append(request)
        return updated

    def _count_decode(self, chunk: ScheduledChunk, num_tokens: int) -> None:
        if not chunk.is_decode:
            return
        if chunk.draft_token_ids and self.proposer is not None:
            self.proposer.record(chunk.request.request_id, num_tokens - 1)
        stats = self.spec_stats
        stats.num_draft_tokens += len(chunk.draft_token_ids)
        stats.num_accepted_tokens += num_tokens - 1
        stats.num_decode_steps += 1
        stats.num_decode_tokens += num_tokens

    # ---- helpers -------------------------------------------------------------------------

    def _order_key(self, request: Request) -> tuple[bool, int, float, int]:
        """Interactive before batch lines, then priority, then arrival: the running list's
        tail, where preemption takes its victims, holds batch lines while there are any."""
        is_batch = request.lane == "batch"
        return (is_batch, request.priority, request.arrival_time, self._seq[request.request_id])

    @staticmethod
    def _remove(queue: list[Request], request: Request) -> None:
        # By identity: dataclass equality would compare whole token lists.
        for index, queued in enumerate(queue):
            if queued is request:
                del queue[index]
                return

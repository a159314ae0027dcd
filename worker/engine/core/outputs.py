"""Plain data passed between scheduler, runner and engine each step (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.core.request import Request


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of one request, starting at position `start_position`.

    `block_ids` is the request's whole block table after allocation. `is_sampling` is true
    when the chunk reaches the end of the request's known tokens, so a token is sampled.
    A speculating decode chunk ends with `draft_token_ids` (proposed, not yet the request's):
    its last known token plus the drafts, each position sampled to verify the next draft.
    """

    request: Request
    start_position: int
    num_tokens: int
    block_ids: list[int]
    is_sampling: bool
    draft_token_ids: list[int] = field(default_factory=list)
    # the sliding-window layers' own table where they have a pool of their own (null-block
    # entries for blocks that slid out of the window); None: they share `block_ids`
    local_block_ids: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        """One new token (plus drafts): attended row by row over the cached blocks."""
        return self.num_tokens == 1 + len(self.draft_token_ids)

    @property
    def num_sampled_rows(self) -> int:
        """Logits rows this chunk needs: one per position that samples."""
        return 1 + len(self.draft_token_ids) if self.is_sampling else 0


@dataclass
class SchedulerOutput:
    """What one engine step computes. Decode chunks (`is_decode`) come first."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass
class TopToken:
    token_id: int
    logprob: float


@dataclass
class SampledToken:
    """The token chosen for one request, with its logprob and top alternatives if asked."""

    token_id: int
    logprob: float | None = None
    top: list[TopToken] | None = None


@dataclass
class ModelRunnerOutput:
    """Tokens keyed by request id, for each sampling chunk: its accepted drafts (if it had
    any) and then the token sampled after them, so always at least one."""

    sampled: dict[str, list[SampledToken]] = field(default_factory=dict)

"""N-gram prompt lookup: draft tokens for speculative decoding without a second model.

Pure Python, never imports torch (the scheduler calls it). For a decoding request, the last
`n` tokens of prompt + output are looked up earlier in the same sequence (the longest match
up to `max_ngram`, at least `min_ngram` = 2, the most recent on ties) and the up to
`num_draft_tokens` tokens that followed that occurrence become the draft. Quoting, editing
and code completion repeat long spans of the prompt, so such drafts are often right; the
model verifies them all in one forward (see `model_runner` and `accept_drafts`).

Wrong drafts cost compute: on a busy CPU a step's matmuls take time in proportion to its
rows, so k drafts cost about k tokens' worth. Two guards keep them rare where the output
does not repeat: a single matching token is not enough (common tokens recur everywhere;
sampling at temperature 1 on random prompts drafted on 23 % of tokens with 4 % accepted and
lost 16-29 % of throughput with one-token matches, `python -m loadtest.bench_speculative`,
2026-11-30), and a request whose draft was rejected outright stops drafting for 1 step,
then 2, 4, 8, up to 16 after further misses in a row; any accepted draft ends the pause.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.core.request import Request

# Earlier occurrences of the last token examined per proposal (most recent first): bounds a
# step's cost on long sequences dominated by a few frequent tokens.
_MAX_CANDIDATES = 64
# Longest pause (in decode steps) after drafts were rejected outright several times in a row.
_MAX_PAUSE = 16


@dataclass
class _TokenIndex:
    """Positions of each token id in a request's sequence, kept up to date incrementally."""

    positions: dict[int, list[int]] = field(default_factory=dict)
    num_indexed: int = 0
    num_misses: int = 0  # drafts rejected outright, in a row
    num_paused_steps: int = 0  # decode steps left without drafting


class NgramProposer:
    """Proposes draft tokens per request from its own prompt + output (prompt lookup)."""

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if num_draft_tokens < 0 or min_ngram < 1 or max_ngram < 1:
            raise ValueError("need num_draft_tokens >= 0 and n-gram sizes >= 1")
        self.num_draft_tokens = num_draft_tokens
        self.max_ngram = max_ngram
        self.min_ngram = min(min_ngram, max_ngram)  # max_ngram 1: single tokens suffice
        self._indexes: dict[str, _TokenIndex] = {}

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Up to `min(num_draft_tokens, max_num_tokens)` tokens likely to follow the request."""
        limit = min(self.num_draft_tokens, max_num_tokens)
        if limit <= 0:
            return []
        index = self._indexes.setdefault(request.request_id, _TokenIndex())
        if index.num_paused_steps > 0:
            index.num_paused_steps -= 1
            return []
        tokens = request.all_token_ids
        self._update_index(index, tokens)
        start = self._best_match(tokens, index.positions.get(tokens[-1], ()))
        if start is None:
            return []
        return tokens[start : start + limit]

    def record(self, request_id: str, num_accepted: int) -> None:
        """Note how many of the request's latest drafts were kept (pauses after misses)."""
        index = self._indexes.get(request_id)
        if index is None:
            return
        if num_accepted:
            index.num_misses = 0
            return
        index.num_misses += 1
        index.num_paused_steps = min(2 ** (index.num_misses - 1), _MAX_PAUSE)

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request's index."""
        self._indexes.pop(request_id, None)

    @staticmethod
    def _update_index(index: _TokenIndex, tokens: list[int]) -> None:
        """Index every position but the last (an occurrence must be followed by a token)."""
        for position in range(index.num_indexed, len(tokens) - 1):
            index.positions.setdefault(tokens[position], []).append(position)
        index.num_indexed = max(index.num_indexed, len(tokens) - 1)

    def _best_match(self, tokens: list[int], positions: list[int] | tuple[()]) -> int | None:
        """Start of the draft after the earlier occurrence with the longest suffix match."""
        last = len(tokens) - 1
        best_length, best_start = 0, None
        for position in reversed(positions[-_MAX_CANDIDATES:]):
            length = 1
            while (
                length < self.max_ngram
                and position - length >= 0
                and tokens[position - length] == tokens[last - length]
            ):
                length += 1
            if length > best_length:
                best_length, best_start = length, position + 1
                if length == self.max_ngram:
                    break
        return best_start if best_length >= self.min_ngram else None


def can_speculate(request: Request) -> bool:
    """Whether the sampler may verify drafts for this request now.

    Verification samples every draft position with the same processing as a plain decode
    step, so that processing must not depend on the tokens generated so far: penalties
    (which count them), an active min_tokens mask and a grammar (its mask depends on every
    accepted token) rule speculation out.
    """
    params = request.sampling_params
    return (
        request.grammar is None
        and params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
        and request.num_output_tokens >= params.min_tokens
    )


def accept_drafts(draft_token_ids: list[int], sampled_token_ids: list[int]) -> int:
    """How many drafts are kept: the longest prefix equal to the tokens sampled before them.

    `sampled_token_ids[i]` is the token sampled at draft position i (from the logits of the
    position before it), so draft i stands only if every earlier draft stood and it equals
    what the model itself picked there. The request then gets `accepted + 1` tokens: the kept
    drafts and the token sampled after the last of them (a correction or a bonus).
    """
    accepted = 0
    for draft, sampled in zip(draft_token_ids, sampled_token_ids, strict=False):
        if draft != sampled:
            break
        accepted += 1
    return accepted

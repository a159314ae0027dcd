"""N-gram prompt lookup, draft acceptance, and the distribution speculative sampling keeps."""

from __future__ import annotations

import torch

from worker.engine.core.ngram import NgramProposer, accept_drafts, can_speculate
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.sampler import Sampler


def make_request(
    tokens: list[int], request_id: str = "r", params: SamplingParams | None = None
) -> Request:
    return Request(request_id, list(tokens), params or SamplingParams(temperature=0.0), 64)


def test_proposes_what_followed_the_longest_most_recent_match() -> None:
    proposer = NgramProposer(num_draft_tokens=3, max_ngram=3)
    # "7 8 9" occurs at 0 (followed by 1 2 3) and, longer-matched, "6 7 8 9" never; the
    # trigram "7 8 9" is also at 6 (followed by 4 5 6): the most recent wins.
    tokens = [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 5, 6, 0, 7, 8, 9]
    assert proposer.propose(make_request(tokens), max_num_tokens=8) == [4, 5, 6]
    # A longer match beats a more recent shorter one: "5 8" (bigram) at 1 vs "8" alone at 4.
    tokens = [5, 8, 1, 2, 8, 3, 5, 8]
    assert proposer.propose(make_request(tokens, "b"), max_num_tokens=8) == [1, 2, 8]


def test_draft_is_capped_and_empty_without_match() -> None:
    proposer = NgramProposer(num_draft_tokens=4, max_ngram=2)
    request = make_request([1, 2, 3, 1, 2, 3, 1])
    assert proposer.propose(request, max_num_tokens=2) == [2, 3]
    assert proposer.propose(request, max_num_tokens=0) == []
    assert proposer.propose(make_request([1, 2, 3, 4], "n"), max_num_tokens=4) == []
    strict = NgramProposer(num_draft_tokens=4, max_ngram=3, min_ngram=2)
    assert strict.propose(make_request([9, 1, 5, 2, 1], "s"), max_num_tokens=4) == []


def test_index_follows_appended_tokens_and_is_released() -> None:
    proposer = NgramProposer(num_draft_tokens=2, max_ngram=2)
    request = make_request([4, 5, 6])
    assert proposer.propose(request, 2) == []
    request.output_token_ids += [4, 5]
    assert proposer.propose(request, 2) == [6, 4]
    proposer.release("r")
    assert proposer._indexes == {}


def test_drafting_pauses_after_outright_misses_and_resumes_on_acceptance() -> None:
    proposer = NgramProposer(num_draft_tokens=2, max_ngram=2)
    request = make_request([1, 2, 1, 2, 1])

    def pause_length() -> int:
        steps = 0
        while not proposer.propose(request, 2):
            steps += 1
        return steps

    assert proposer.propose(request, 2) == [2, 1]
    pauses = []
    for _ in range(6):
        proposer.record("r", num_accepted=0)
        pauses.append(pause_length())
    assert pauses == [1, 2, 4, 8, 16, 16]
    proposer.record("r", num_accepted=1)
    assert proposer.propose(request, 2) == [2, 1]
    proposer.record("r", num_accepted=0)
    assert pause_length() == 1  # the run of misses starts again


def test_accept_drafts_keeps_longest_agreeing_prefix() -> None:
    assert accept_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accept_drafts([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accept_drafts([5, 6, 7], [4, 6, 7, 8]) == 0
    assert accept_drafts([], [3]) == 0


def test_penalties_and_pending_min_tokens_rule_speculation_out() -> None:
    assert can_speculate(make_request([1], params=SamplingParams(temperature=0.7, top_k=5)))
    assert not can_speculate(make_request([1], params=SamplingParams(presence_penalty=0.5)))
    assert not can_speculate(make_request([1], params=SamplingParams(repetition_penalty=1.1)))
    waiting = make_request([1], params=SamplingParams(min_tokens=2))
    assert not can_speculate(waiting)
    waiting.output_token_ids += [3, 4]
    assert can_speculate(waiting)


P_FIRST = [0.1, 0.4, 0.2, 0.3, 0.0]
P_SECOND = [0.25, 0.05, 0.5, 0.1, 0.1]
DRAFT = [1, 2]


def _verify_many(num_trials: int, params: SamplingParams) -> tuple[list[int], list[list[int]]]:
    """Verify the same drafts `num_trials` times against fixed per-position probabilities."""
    requests = [make_request([0], f"t{i}", params) for i in range(num_trials)]
    rows = [request for request in requests for _ in range(len(DRAFT) + 1)]
    position_probs = torch.tensor([P_FIRST, P_SECOND, P_FIRST])
    logits = position_probs.log().repeat(num_trials, 1)
    torch.manual_seed(0)
    sampled = Sampler().sample(logits, rows)
    accepted, tokens = [], []
    for trial in range(num_trials):
        row_tokens = [s.token_id for s in sampled[3 * trial : 3 * trial + 3]]
        kept = accept_drafts(DRAFT, row_tokens)
        accepted.append(kept)
        tokens.append(row_tokens[: kept + 1])
    return accepted, tokens


def _frequencies(values: list[int], size: int) -> list[float]:
    counts = [0] * size
    for value in values:
        counts[value] += 1
    return [count / max(len(values), 1) for count in counts]


def _top_k(probs: list[float], top_k: int) -> list[float]:
    """The distribution top_k sampling draws from (ties with the cut-off kept)."""
    if top_k == 0:
        return probs
    cut = sorted(probs, reverse=True)[top_k - 1]
    kept = [p if p >= cut else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


def test_verification_keeps_the_target_distribution() -> None:
    """Point-mass drafts: d kept with probability p(d); a rejection draws from p without d.

    Whatever is accepted, each output token must follow the model's own distribution at its
    position, exactly as plain sampling would (20,000 trials; 4.5 sigma tolerances).
    """
    num_trials = 20_000
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=4)):
        accepted, tokens = _verify_many(num_trials, params)
        p_first, p_second = _top_k(P_FIRST, params.top_k), _top_k(P_SECOND, params.top_k)
        tolerance = 4.5 * (0.25 / num_trials) ** 0.5
        first = _frequencies([t[0] for t in tokens], 5)
        assert all(abs(f - p) < tolerance for f, p in zip(first, p_first, strict=True))
        assert abs(sum(a >= 1 for a in accepted) / num_trials - p_first[DRAFT[0]]) < tolerance
        rejected = [t[0] for t in tokens if t[0] != DRAFT[0]]
        without_draft = [p / (1 - p_first[DRAFT[0]]) for p in p_first]
        without_draft[DRAFT[0]] = 0.0
        tolerance_rejected = 4.5 * (0.25 / len(rejected)) ** 0.5
        for f, p in zip(_frequencies(rejected, 5), without_draft, strict=True):
            assert abs(f - p) < tolerance_rejected
        second = [t[1] for t in tokens if len(t) > 1]
        tolerance_second = 4.5 * (0.25 / len(second)) ** 0.5
        for f, p in zip(_frequencies(second, 5), p_second, strict=True):
            assert abs(f - p) < tolerance_second


def test_seeded_rows_match_plain_steps_and_rewind_undoes_unused_draws() -> None:
    """A seeded request verifying k drafts draws what k + 1 plain steps would, in order;
    rewinding the rejected rows leaves its generator where plain decoding would have it."""
    params = SamplingParams(temperature=1.0, seed=7)
    logits = torch.randn(3, 50)
    plain, speculative = Sampler(), Sampler()
    request = make_request([0], "s", params)
    one_by_one = [plain.sample(logits[i : i + 1], [request])[0].token_id for i in range(3)]
    together = [s.token_id for s in speculative.sample(logits, [request] * 3)]
    assert together == one_by_one
    speculative.rewind("s", 2)  # only the first row was used
    replay = Sampler()
    replay.sample(logits[:1], [request])
    next_logits = torch.randn(1, 50)
    assert (
        speculative.sample(next_logits, [request])[0].token_id
        == replay.sample(next_logits, [request])[0].token_id
    )

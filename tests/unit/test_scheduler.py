"""Exact scheduling decisions: chunk sizes, admission, preemption, priority, abort."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from worker.engine.core.block_manager import BlockManager
from worker.engine.core.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from worker.engine.core.request import Request, RequestStatus
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.core.scheduler import Scheduler, SchedulerConfig

BS = 4


def make_request(
    request_id: str,
    num_prompt_tokens: int,
    *,
    arrival: float,
    priority: int = 0,
    max_tokens: int = 4,
    first_token: int = 0,
    lane: str = "interactive",
) -> Request:
    return Request(
        request_id,
        list(range(first_token, first_token + num_prompt_tokens)),
        SamplingParams(temperature=0.0),
        max_tokens=max_tokens,
        priority=priority,
        lane=lane,
        arrival_time=arrival,
    )


_made: list[Scheduler] = []


def make_scheduler(num_blocks: int = 16, caching: bool = True, **config: int | bool) -> Scheduler:
    limits = {
        "max_num_seqs": 64,
        "max_num_batched_tokens": 1024,
        "max_model_len": 8192,
        "num_speculative_tokens": 0,
        "speculative_max_ngram": 3,
    }
    scheduler = Scheduler(
        SchedulerConfig(**{**limits, **config}),  # type: ignore[arg-type]
        BlockManager(num_blocks, BS, enable_prefix_caching=caching),
    )
    _made.append(scheduler)
    return scheduler


@pytest.fixture(autouse=True)
def all_blocks_free_after_finish() -> Iterator[None]:
    """Every test ends with its requests finished; then no block may stay referenced."""
    _made.clear()
    yield
    for scheduler in _made:
        run_until_done(scheduler)
        bm = scheduler.block_manager
        assert not scheduler.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks
        assert all(bm.get_ref_count(i) == 0 for i in range(bm.num_blocks))


def step(scheduler: Scheduler) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step: schedule, fake the runner (token = 1000 + position), update, stop."""
    output = scheduler.schedule()
    sampled = {
        chunk.request.request_id: [SampledToken(token_id=1000 + chunk.request.num_tokens)]
        for chunk in output.chunks
        if chunk.is_sampling
    }
    updated = scheduler.update_from_output(output, ModelRunnerOutput(sampled=sampled))
    for request in updated:
        if request.num_output_tokens >= request.max_tokens:
            scheduler.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
    return output, updated


def run_until_done(scheduler: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler)
    raise AssertionError("requests did not finish")


def shape(output: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [
        (c.request.request_id, c.start_position, c.num_tokens, c.is_sampling) for c in output.chunks
    ]


def test_chunked_prefill_under_token_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 20, arrival=0))
    sizes = [shape(step(scheduler)[0]) for _ in range(4)]
    assert sizes == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
        [("a", 20, 1, True)],
    ]
    request = scheduler.get_request("a")
    assert request.output_token_ids == [1020, 1021]
    assert request.num_computed_tokens == 21
    assert request.first_scheduled_time is not None and request.first_token_time is not None


def test_block_ids_are_whole_table_after_allocation() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=6)
    scheduler.add_request(make_request("a", 10, arrival=0))
    first, _ = step(scheduler)
    assert first.chunks[0].block_ids == [0, 1]
    second, _ = step(scheduler)
    assert second.chunks[0].block_ids == [0, 1, 2]


def test_decode_and_prefill_in_one_step_decodes_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("a", 3, arrival=0))
    assert shape(step(scheduler)[0]) == [("a", 0, 3, True)]
    scheduler.add_request(make_request("c", 12, arrival=1, priority=-1, first_token=500))
    assert shape(step(scheduler)[0]) == [("a", 3, 1, True), ("c", 0, 7, False)]
    # c now runs ahead of a (better priority) but its prefill chunk is listed after a's decode.
    assert [r.request_id for r in scheduler.running] == ["c", "a"]
    assert shape(step(scheduler)[0]) == [("a", 4, 1, True), ("c", 7, 5, True)]


def test_max_num_seqs_caps_running() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for index, name in enumerate("abc"):
        scheduler.add_request(make_request(name, 3, arrival=index, max_tokens=2))
    output, _ = step(scheduler)
    assert [c.request.request_id for c in output.chunks] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    output, _ = step(scheduler)  # a and b get their second token and finish
    assert [c.request.request_id for c in output.chunks] == ["a", "b"]
    assert scheduler.num_running == 0
    output, _ = step(scheduler)
    assert shape(output) == [("c", 0, 3, True)]
    assert output.finished_request_ids == ["a", "b"]


def test_unchunked_prefill_waits_until_it_fits_whole() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    scheduler.add_request(make_request("a", 4, arrival=0, max_tokens=3))
    scheduler.add_request(make_request("b", 8, arrival=1, max_tokens=1, first_token=100))
    assert shape(step(scheduler)[0]) == [("a", 0, 4, True)]
    # b needs 8 tokens but a's decode leaves 7: b waits.
    assert shape(step(scheduler)[0]) == [("a", 4, 1, True)]
    assert shape(step(scheduler)[0]) == [("a", 5, 1, True)]
    assert shape(step(scheduler)[0]) == [("b", 0, 8, True)]


def test_unchunked_recompute_longer_than_budget_is_still_chunked() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    request = make_request("a", 4, arrival=0, max_tokens=11)
    request.output_token_ids = list(range(500, 510))  # as if preempted after 10 tokens
    scheduler.add_request(request)
    outputs = [shape(step(scheduler)[0]) for _ in range(2)]
    assert outputs == [[("a", 0, 8, False)], [("a", 8, 6, True)]]


def test_preemption_by_recompute_restarts_at_cached_prefix() -> None:
    scheduler = make_scheduler(num_blocks=4)
    bm = scheduler.block_manager
    a = make_request("a", 7, arrival=0, max_tokens=3)
    b = make_request("b", 7, arrival=1, max_tokens=3, first_token=100)
    c = make_request("c", 2, arrival=2, max_tokens=1, first_token=200)
    scheduler.add_request(a)
    scheduler.add_request(b)
    assert shape(step(scheduler)[0]) == [("a", 0, 7, True), ("b", 0, 7, True)]
    assert (bm.get_block_ids("a"), bm.get_block_ids("b")) == ([0, 1], [2, 3])
    scheduler.add_request(c)  # no free block: c waits
    assert shape(step(scheduler)[0]) == [("a", 7, 1, True), ("b", 7, 1, True)]
    assert scheduler.num_waiting == 1
    # a's third token needs a third block: b (latest arrival) is preempted, no admission.
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["b"]
    assert shape(output) == [("a", 8, 1, True)]
    assert output.chunks[0].block_ids == [0, 1, 3]
    assert b.status is RequestStatus.PREEMPTED
    assert (b.num_preemptions, scheduler.num_preemptions_total) == (1, 1)
    assert b.num_computed_tokens == 0
    assert bm.get_block_ids("b") == []
    # b's blocks were freed tail-first: a took block 3, so b's head block 2 stays cached.
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]
    assert a.status is RequestStatus.FINISHED_LENGTH  # a reached max_tokens
    # b comes back first; its first block (still cached) is not recomputed.
    output, _ = step(scheduler)
    assert shape(output) == [("b", 4, 5, True), ("c", 0, 2, True)]
    assert b.num_cached_tokens == 4
    assert [chunk.block_ids for chunk in output.chunks] == [[2, 3, 1], [0]]
    assert b.output_token_ids == [1007, 1008, 1009]


def test_preemption_without_prefix_cache_restarts_at_zero() -> None:
    scheduler = make_scheduler(num_blocks=4, caching=False)
    a = make_request("a", 7, arrival=0, max_tokens=3)
    b = make_request("b", 7, arrival=1, max_tokens=3, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    step(scheduler)
    step(scheduler)
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["b"]
    output, _ = step(scheduler)
    assert shape(output) == [("b", 0, 9, True)]
    assert b.output_token_ids == [1007, 1008, 1009]


def test_preemption_picks_worst_priority_not_latest_arrival() -> None:
    scheduler = make_scheduler(num_blocks=4)
    hi = make_request("hi", 7, arrival=1, priority=-1, max_tokens=4)
    lo = make_request("lo", 7, arrival=0, priority=0, max_tokens=3, first_token=100)
    scheduler.add_request(lo)
    scheduler.add_request(hi)
    assert shape(step(scheduler)[0]) == [("hi", 0, 7, True), ("lo", 0, 7, True)]
    step(scheduler)
    # Both need a third block; hi is served first and preempts lo (worse priority, although
    # it arrived earlier).
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["lo"]
    assert shape(output) == [("hi", 8, 1, True)]
    assert scheduler.block_manager.get_block_ids("hi") == [0, 1, 3]


def test_batch_lines_are_preempted_before_any_interactive_request() -> None:
    scheduler = make_scheduler(num_blocks=4)
    line = make_request("line", 7, arrival=0, priority=-50, max_tokens=3, lane="batch")
    chat = make_request("chat", 7, arrival=1, priority=10, max_tokens=4, first_token=100)
    scheduler.add_request(line)
    scheduler.add_request(chat)
    # The interactive request goes first despite a worse priority and a later arrival (its
    # prompt alone), then the line joins.
    assert shape(step(scheduler)[0]) == [("chat", 0, 7, True)]
    assert shape(step(scheduler)[0]) == [("chat", 7, 1, True), ("line", 0, 7, True)]
    output, _ = step(scheduler)  # both need a third block: the batch line gives way
    assert output.preempted_request_ids == ["line"]
    assert shape(output) == [("chat", 8, 1, True)]


def test_interactive_requests_are_admitted_before_waiting_batch_lines() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("line0", 2, arrival=0, max_tokens=1, lane="batch"))
    scheduler.add_request(
        make_request("line1", 2, arrival=1, priority=-9, max_tokens=1, lane="batch")
    )
    scheduler.add_request(make_request("chat", 2, arrival=5, priority=100, max_tokens=1))
    order = [step(scheduler)[0].chunks[0].request.request_id for _ in range(3)]
    assert order == ["chat", "line1", "line0"]


def test_priority_orders_waiting_queue_fcfs_within_priority() -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("late_low", 2, arrival=3, priority=1, max_tokens=1))
    scheduler.add_request(make_request("b", 2, arrival=2, max_tokens=1))
    scheduler.add_request(make_request("a", 2, arrival=1, max_tokens=1))
    scheduler.add_request(make_request("urgent", 2, arrival=4, priority=-5, max_tokens=1))
    assert [r.request_id for r in scheduler.waiting] == ["urgent", "a", "b", "late_low"]
    order = [step(scheduler)[0].chunks[0].request.request_id for _ in range(4)]
    assert order == ["urgent", "a", "b", "late_low"]


def test_strict_fcfs_head_blocks_smaller_requests() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("a", 8, arrival=0, max_tokens=2))
    scheduler.add_request(make_request("big", 12, arrival=1, max_tokens=1, first_token=100))
    scheduler.add_request(make_request("small", 2, arrival=2, max_tokens=1, first_token=200))
    output, _ = step(scheduler)
    # big needs 3 blocks but only 2 are free; small would fit but must not overtake.
    assert shape(output) == [("a", 0, 8, True)]
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]
    assert scheduler.block_manager.num_free_blocks == 2


def test_prefix_hit_on_admission_skips_cached_tokens() -> None:
    scheduler = make_scheduler()
    bm = scheduler.block_manager
    scheduler.add_request(make_request("a", 10, arrival=0, max_tokens=1))
    step(scheduler)
    b = make_request("b", 11, arrival=1, max_tokens=1)
    scheduler.add_request(b)
    output, _ = step(scheduler)
    assert shape(output) == [("b", 8, 3, True)]
    assert b.num_cached_tokens == 8
    assert output.chunks[0].block_ids[:2] == [0, 1]
    assert (bm.num_prefix_query_tokens, bm.num_prefix_hit_tokens) == (21, 8)


def test_request_preempts_itself_when_it_is_the_worst() -> None:
    scheduler = make_scheduler(num_blocks=4)
    hi = make_request("hi", 6, arrival=0, priority=-1, max_tokens=3)
    lo = make_request("lo", 7, arrival=1, max_tokens=3, first_token=100)
    scheduler.add_request(hi)
    scheduler.add_request(lo)
    step(scheduler)
    step(scheduler)
    # lo's token 8 needs a third block; hi holds the other two and lo is the worst itself.
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["lo"]
    assert shape(output) == [("hi", 7, 1, True)]
    assert lo.status is RequestStatus.PREEMPTED and lo.num_computed_tokens == 0
    assert [r.request_id for r in scheduler.waiting] == ["lo"]


@pytest.mark.parametrize("state", ["waiting", "running", "preempted"])
def test_abort_frees_blocks_at_once(state: str) -> None:
    scheduler = make_scheduler(num_blocks=4)
    bm = scheduler.block_manager
    a = make_request("a", 7, arrival=0, max_tokens=3)
    b = make_request("b", 7, arrival=1, max_tokens=3, first_token=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    if state != "waiting":
        step(scheduler)
        assert bm.get_block_ids("b") == [2, 3]
    if state == "preempted":
        step(scheduler)
        step(scheduler)
        assert b.status is RequestStatus.PREEMPTED
    output = scheduler.schedule() if state == "running" else None
    aborted = scheduler.abort_requests(["b", "unknown"])
    assert aborted == [b]
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert bm.get_block_ids("b") == []
    assert scheduler.get_request("b") is None
    assert "b" not in [r.request_id for r in scheduler.running + scheduler.waiting]
    assert bm.num_free_blocks == bm.num_blocks - len(bm.get_block_ids("a"))
    if output is not None:  # the aborted request's in-flight chunk is ignored
        updated = scheduler.update_from_output(
            output, ModelRunnerOutput({"a": [SampledToken(5)], "b": [SampledToken(6)]})
        )
        assert updated == [a]
        assert b.output_token_ids == [1007]
    assert "b" in scheduler.schedule().finished_request_ids


def test_prompt_larger_than_cache_is_rejected() -> None:
    scheduler = make_scheduler(num_blocks=4)
    with pytest.raises(ValueError, match="KV cache"):
        scheduler.add_request(make_request("huge", 16, arrival=0))
    scheduler.add_request(make_request("fits", 15, arrival=0, max_tokens=1))
    with pytest.raises(ValueError, match="context length"):
        make_scheduler(max_model_len=8).add_request(make_request("long", 9, arrival=0))
    unchunked = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="chunked prefill"):
        unchunked.add_request(make_request("wide", 9, arrival=0))


def test_request_outgrowing_whole_cache_is_stopped() -> None:
    scheduler = make_scheduler(num_blocks=2)
    request = make_request("a", 6, arrival=0, max_tokens=100)
    scheduler.add_request(request)
    outputs = [step(scheduler)[0] for _ in range(4)]
    assert [shape(o) for o in outputs[:3]] == [
        [("a", 0, 6, True)],
        [("a", 6, 1, True)],
        [("a", 7, 1, True)],
    ]
    # 9 known tokens can never be in an 8-token cache.
    assert request.status is RequestStatus.FINISHED_LENGTH
    assert outputs[3].finished_request_ids == ["a"]


@pytest.mark.parametrize("num_drafts", [0, 3])
def test_random_workload_keeps_kv_content_consistent(num_drafts: int) -> None:
    """Fake KV store: every computed position must read back the token written for it.

    With speculation, draft positions are written with the drafts and a random prefix of
    them is accepted: rolled-back content must never be read, nor found by a prefix hit.
    """
    rng = random.Random(0)
    scheduler = make_scheduler(
        num_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=5,
        num_speculative_tokens=num_drafts,
        speculative_max_ngram=1,  # draft on any repeated token: many drafts, many rejected
    )
    bm = scheduler.block_manager
    prefixes = [[rng.randrange(50) for _ in range(9)] for _ in range(3)]
    for index in range(30):
        prompt = rng.choice(prefixes)[: rng.randrange(1, 10)] + [rng.randrange(50)] * rng.randrange(
            4
        )
        scheduler.add_request(
            Request(
                f"r{index}",
                prompt,
                SamplingParams(),
                max_tokens=rng.randrange(1, 12),
                priority=rng.randrange(2),
                arrival_time=float(index),
            )
        )
    kv: dict[tuple[int, int], int] = {}
    for _ in range(2000):
        if not scheduler.has_unfinished_requests():
            break
        output = scheduler.schedule()
        assert output.num_batched_tokens <= 16 and len(scheduler.running) <= 5
        for chunk in output.chunks:
            tokens = chunk.request.all_token_ids + chunk.draft_token_ids
            table = chunk.block_ids
            for pos in range(chunk.start_position):
                assert kv[(table[pos // BS], pos % BS)] == tokens[pos]
            for pos in range(chunk.start_position, chunk.start_position + chunk.num_tokens):
                kv[(table[pos // BS], pos % BS)] = tokens[pos]
        sampled = {
            c.request.request_id: [
                SampledToken(t)
                for t in c.draft_token_ids[: rng.randint(0, len(c.draft_token_ids))]
                + [rng.randrange(50)]
            ]
            for c in output.chunks
            if c.is_sampling
        }
        for request in scheduler.update_from_output(output, ModelRunnerOutput(sampled)):
            if request.num_output_tokens >= request.max_tokens:
                scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        if rng.random() < 0.05 and scheduler.requests:
            scheduler.abort_requests([rng.choice(sorted(scheduler.requests))])
        held = sum(len(bm.get_block_ids(r.request_id)) for r in scheduler.running)
        assert held == sum(bm.get_ref_count(i) for i in range(bm.num_blocks))
    assert not scheduler.has_unfinished_requests()
    assert bm.num_prefix_hit_tokens > 0 and scheduler.num_preemptions_total > 0
    stats = scheduler.spec_stats
    assert (0 < stats.num_accepted_tokens < stats.num_draft_tokens) == (num_drafts > 0)


def test_speculation_rolls_back_rejected_drafts_exactly() -> None:
    scheduler = make_scheduler(num_blocks=16, num_speculative_tokens=3)
    bm = scheduler.block_manager
    request = Request("a", [1, 2, 3, 1, 2], SamplingParams(temperature=0.0), max_tokens=8)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"a": [SampledToken(3)]}))
    assert request.all_token_ids == [1, 2, 3, 1, 2, 3]

    # "1 2 3" was followed by "1 2 3": one step computes the last token and three drafts.
    output = scheduler.schedule()
    chunk = output.chunks[0]
    assert (chunk.start_position, chunk.num_tokens, chunk.draft_token_ids) == (5, 4, [1, 2, 3])
    assert len(bm.get_block_ids("a")) == 3
    third_block = bm.get_block_ids("a")[2]
    # The first draft stands, the second does not: the model picked 7 there.
    kept = [SampledToken(1), SampledToken(7)]
    scheduler.update_from_output(output, ModelRunnerOutput({"a": kept}))
    assert request.output_token_ids == [3, 1, 7]
    assert request.num_computed_tokens == 7  # prompt 5 + the last token and one draft
    assert len(bm.get_block_ids("a")) == 2  # 8 tokens known: the third block is released
    assert bm.get_ref_count(third_block) == 0 and bm.free_block_ids()[0] == third_block
    assert bm.num_cached_blocks == 1  # [1 2 3 1]; [2 3 1 7] is not computed to its end
    stats = scheduler.spec_stats
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (3, 1)
    assert (stats.num_decode_steps, stats.num_decode_tokens) == (1, 2)

    # "1 7" and then "7 2" occurred nowhere before: plain decode steps. Then "2 3" did (twice;
    # the most recent counts): drafts again, capped by max_tokens, all accepted, plus a bonus.
    for token in (2, 3):
        output = scheduler.schedule()
        assert [(c.num_tokens, c.draft_token_ids) for c in output.chunks] == [(1, [])]
        scheduler.update_from_output(output, ModelRunnerOutput({"a": [SampledToken(token)]}))
    output = scheduler.schedule()
    assert output.chunks[0].draft_token_ids == [1, 7]  # 3 follow, but 8 - 5 outputs - 1 = 2
    kept = [SampledToken(t) for t in output.chunks[0].draft_token_ids] + [SampledToken(9)]
    scheduler.update_from_output(output, ModelRunnerOutput({"a": kept}))
    assert request.output_token_ids == [3, 1, 7, 2, 3, 1, 7, 9]
    assert request.num_computed_tokens == request.num_tokens - 1
    assert len(bm.get_block_ids("a")) == 3  # 12 computed; the bonus token's slot comes next step
    scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)


def test_drafts_never_exceed_max_tokens_budget_or_free_blocks() -> None:
    scheduler = make_scheduler(num_blocks=3, num_speculative_tokens=4, max_num_batched_tokens=16)
    request = Request("a", [5, 6, 5, 6, 5, 6, 5], SamplingParams(temperature=0.0), max_tokens=3)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"a": [SampledToken(6)]}))
    output = scheduler.schedule()
    # 2 outputs still allowed: one draft at most (the step's own token is the second).
    assert output.chunks[0].draft_token_ids == [5]
    scheduler.update_from_output(output, ModelRunnerOutput({"a": [SampledToken(4)]}))
    scheduler.finish_request("a", RequestStatus.FINISHED_LENGTH)

    long = Request("b", [5, 6] * 5 + [5], SamplingParams(temperature=0.0), max_tokens=8)
    scheduler.add_request(long)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"b": [SampledToken(6)]}))
    # 12 tokens fill all 3 blocks: drafts would need a fourth, so none are proposed.
    output = scheduler.schedule()
    assert output.chunks[0].draft_token_ids == [] and not output.preempted_request_ids
    scheduler.finish_request("b", RequestStatus.FINISHED_LENGTH)


def test_batch_lines_sit_out_steps_while_an_interactive_prompt_is_computed() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(make_request("line", 3, arrival=0, max_tokens=6, lane="batch"))
    step(scheduler)  # the line's prefill
    assert shape(step(scheduler)[0]) == [("line", 3, 1, True)]  # decoding alone
    scheduler.add_request(make_request("chat", 12, arrival=1, max_tokens=2, first_token=100))
    # The interactive prompt (12 tokens, chunked 8 + 4) runs in steps of its own ...
    assert shape(step(scheduler)[0]) == [("chat", 0, 8, False)]
    assert shape(step(scheduler)[0]) == [("chat", 8, 4, True)]
    # ... then the batch line decodes again, after the interactive decode.
    assert shape(step(scheduler)[0]) == [("chat", 12, 1, True), ("line", 4, 1, True)]


def test_a_held_batch_line_gives_its_blocks_to_an_interactive_request() -> None:
    scheduler = make_scheduler(num_blocks=4)
    scheduler.add_request(make_request("line", 11, arrival=0, max_tokens=3, lane="batch"))
    step(scheduler)  # the line holds 3 of the 4 blocks
    scheduler.add_request(make_request("chat", 7, arrival=1, max_tokens=2, first_token=100))
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["line"]
    assert shape(output) == [("chat", 0, 7, True)]

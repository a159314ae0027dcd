"""Sampler: greedy, filters, penalties, bias, min_tokens, seeds and logprobs."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.sampler import Sampler, _top_k_top_p, first_max
from worker.layers import native

torch.set_num_threads(1)

VOCAB = 32
_ids = itertools.count()


def make_request(
    output: list[int] | None = None,
    prompt: list[int] | None = None,
    eos: frozenset[int] = frozenset({0}),
    request_id: str | None = None,
    **params: object,
) -> Request:
    return Request(
        request_id=request_id or f"r{next(_ids)}",
        prompt_token_ids=prompt if prompt is not None else [5, 6, 7],
        sampling_params=SamplingParams(**params),
        max_tokens=16,
        eos_token_ids=eos,
        output_token_ids=list(output or []),
    )


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def draw(logits_row: torch.Tensor, request_factory, times: int = 400) -> Counter:
    """Sample `times` tokens from a batch of identical rows, one fresh request per row."""
    sampler = Sampler()
    requests = [request_factory() for _ in range(times)]
    tokens = sampler.sample(logits_row.expand(times, -1).clone(), requests)
    return Counter(t.token_id for t in tokens)


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits(6)
    requests = [make_request(temperature=0.0) for _ in range(6)]
    tokens = Sampler().sample(logits, requests)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert all(t.logprob is None and t.top is None for t in tokens)


def test_greedy_with_processors_uses_processed_logits() -> None:
    logits = random_logits(1)
    best = int(logits.argmax())
    other = (best + 1) % VOCAB
    request = make_request(temperature=0.0, logit_bias={other: 100.0})
    assert Sampler().sample(logits, [request])[0].token_id == other


def test_top_k_one_equals_greedy() -> None:
    logits = random_logits(8, seed=3)
    requests = [make_request(temperature=1.0, top_k=1) for _ in range(8)]
    tokens = Sampler().sample(logits, requests)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = random_logits(6, seed=7)
    alone = Sampler()
    crowded = Sampler()
    seeded_params = dict(temperature=0.9, top_p=0.95, seed=1234)
    alone_tokens, crowded_tokens = [], []
    for step in range(20):
        step_logits = logits.roll(step, dims=1)
        req = make_request(request_id="seeded", **seeded_params)
        alone_tokens.append(alone.sample(step_logits[:1], [req])[0].token_id)
        others = [
            make_request(temperature=0.7),
            make_request(temperature=0.0),
            make_request(temperature=1.2, top_k=5, seed=step),
            make_request(temperature=1.0, min_p=0.1, frequency_penalty=0.5, output=[1, 2]),
            make_request(temperature=1.0, logprobs=3),
        ]
        batch = [others[0], others[1], req, *others[2:]]
        batch_logits = torch.cat([step_logits[1:3], step_logits[:1], step_logits[3:]])
        crowded_tokens.append(crowded.sample(batch_logits, batch)[2].token_id)
    assert alone_tokens == crowded_tokens
    assert len(set(alone_tokens)) > 1  # it really sampled


def test_release_drops_generator_and_restarts_the_seed() -> None:
    logits = random_logits(1, seed=11)
    sampler = Sampler()
    req = make_request(request_id="s", temperature=1.0, seed=5)
    first = [sampler.sample(logits, [req])[0].token_id for _ in range(10)]
    sampler.release(["s"])
    again = [sampler.sample(logits, [req])[0].token_id for _ in range(10)]
    assert first == again


def test_logit_bias_bans_and_forces() -> None:
    logits = torch.zeros(VOCAB)
    logits[3] = 4.0
    banned = draw(logits, lambda: make_request(temperature=1.0, logit_bias={3: -100.0}))
    assert banned[3] == 0
    assert len(banned) > 10
    forced = draw(logits, lambda: make_request(temperature=1.0, logit_bias={9: 100.0}))
    assert forced == Counter({9: 400})


def test_frequency_penalty_lowers_repeated_token() -> None:
    logits = torch.zeros(VOCAB)
    plain = draw(logits, lambda: make_request(temperature=1.0, output=[4, 4, 4]), times=3000)
    penalised = draw(
        logits,
        lambda: make_request(temperature=1.0, output=[4, 4, 4], frequency_penalty=1.0),
        times=3000,
    )
    assert plain[4] > 50  # about 3000 / 32
    assert penalised[4] < 15  # weight e^-3 relative to the others


def test_presence_penalty_exact_logit_shift() -> None:
    logits = torch.zeros(1, VOCAB)
    request = make_request(
        temperature=0.0, output=[4, 4, 6], presence_penalty=-2.0, frequency_penalty=0.5
    )
    # token 4: -(-2) - 0.5*2 = +1.0; token 6: +2 - 0.5 = +1.5 -> greedy picks 6
    assert Sampler().sample(logits, [request])[0].token_id == 6
    request.sampling_params.frequency_penalty = 0.0
    request.sampling_params.presence_penalty = 1.0
    logits[0, 4] = 0.5
    # token 4 drops to -0.5, all untouched tokens stay 0: argmax picks the first zero, token 0
    assert Sampler().sample(logits, [request])[0].token_id == 0


def test_repetition_penalty_hf_semantics() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 3.0  # in the prompt: 3 / 2 = 1.5
    logits[0, 9] = 2.0  # not seen: stays 2.0
    logits[0, 10] = -1.0  # in the output: -1 * 2 = -2
    request = make_request(temperature=0.0, prompt=[5], output=[10], repetition_penalty=2.0)
    assert Sampler().sample(logits, [request])[0].token_id == 9
    request.sampling_params.repetition_penalty = 1.2  # 3 / 1.2 = 2.5 > 2
    assert Sampler().sample(logits, [request])[0].token_id == 5
    rare = draw(
        logits[0],
        lambda: make_request(temperature=1.0, prompt=[5], repetition_penalty=2.0),
        times=2000,
    )
    common = draw(logits[0], lambda: make_request(temperature=1.0, prompt=[5]), times=2000)
    assert rare[5] < common[5]


def test_min_p_support_is_exact() -> None:
    logits = torch.log(torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.07]))
    logits = torch.cat([logits, torch.full((VOCAB - 6,), -30.0)])
    # min_p 0.3 keeps probs >= 0.12: tokens 0, 1, 2
    counts = draw(logits, lambda: make_request(temperature=1.0, min_p=0.3), times=2000)
    assert set(counts) == {0, 1, 2}


def test_top_p_support_is_exact() -> None:
    logits = torch.log(torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.07]))
    logits = torch.cat([logits, torch.full((VOCAB - 6,), -30.0)])
    # cumulative 0.4, 0.6, 0.75, 0.85: the smallest set reaching 0.7 is tokens 0..2
    counts = draw(logits, lambda: make_request(temperature=1.0, top_p=0.7), times=2000)
    assert set(counts) == {0, 1, 2}
    # top_p below the top token's probability keeps only the top token
    counts = draw(logits, lambda: make_request(temperature=1.0, top_p=0.1), times=200)
    assert set(counts) == {0}
    # top_p 0.8 alone needs tokens 0..3 (cumulative 0.85) ...
    counts = draw(logits, lambda: make_request(temperature=1.0, top_p=0.8), times=2000)
    assert set(counts) == {0, 1, 2, 3}
    # ... but after top_k 4 the renormalised cumulative is 0.47, 0.71, 0.88: tokens 0..2
    counts = draw(logits, lambda: make_request(temperature=1.0, top_k=4, top_p=0.8), times=2000)
    assert set(counts) == {0, 1, 2}


def _reference_num_kept(row: torch.Tensor, top_k: int, top_p: float) -> int:
    ordered = row.double().sort(descending=True).values
    if top_k:
        ordered = ordered[:top_k]
    cumulative = ordered.softmax(-1).cumsum(-1)
    return min(int((cumulative < top_p).sum()) + 1, len(ordered))


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.97])
def test_top_k_top_p_cut_matches_reference_on_a_large_vocab(top_p: float) -> None:
    # a flat distribution over 5000 tokens needs more than the 1024 candidates at high top_p
    logits = torch.randn(4, 5000, generator=torch.Generator().manual_seed(1)) * 0.5
    settings = [(0, top_p), (50, top_p), (2000, top_p), (7, 1.0)]
    params = [SamplingParams(top_k=k, top_p=p) for k, p in settings]
    kept = torch.isfinite(_top_k_top_p(logits, params)).sum(-1).tolist()
    assert kept == [_reference_num_kept(logits[i], k, p) for i, (k, p) in enumerate(settings)]


def test_mixed_batch_filters_are_per_row() -> None:
    logits = torch.log(torch.tensor([0.4, 0.2, 0.15, 0.1, 0.08, 0.07]))
    logits = torch.cat([logits, torch.full((VOCAB - 6,), -30.0)]).expand(600, -1).clone()
    requests = [
        make_request(temperature=1.0, top_k=2) if i % 2 else make_request(temperature=1.0)
        for i in range(600)
    ]
    tokens = Sampler().sample(logits, requests)
    assert {t.token_id for t in tokens[1::2]} == {0, 1}
    assert len({t.token_id for t in tokens[0::2]}) >= 5


def test_min_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos
    logits[0, 7] = 9.0  # stop token id
    params = dict(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    assert Sampler().sample(logits, [make_request(output=[3], **params)])[0].token_id not in (0, 7)
    assert Sampler().sample(logits, [make_request(output=[3, 4], **params)])[0].token_id == 0
    ignore = make_request(output=[], ignore_eos=True, **params)
    assert Sampler().sample(logits, [ignore])[0].token_id == 0


def test_logprobs_from_raw_logits() -> None:
    logits = random_logits(3, seed=5)
    requests = [
        make_request(temperature=1.0, logprobs=5, frequency_penalty=1.0, output=[1]),
        make_request(temperature=0.0),
        make_request(temperature=0.0, logprobs=0),
    ]
    tokens = Sampler().sample(logits, requests)
    expected = logits.log_softmax(-1)
    first = tokens[0]
    assert first.logprob == pytest.approx(float(expected[0, first.token_id]), abs=1e-5)
    assert len(first.top) == 5
    values = [t.logprob for t in first.top]
    assert values == sorted(values, reverse=True)
    assert [t.token_id for t in first.top] == expected[0].topk(5).indices.tolist()
    assert values == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-5)
    assert tokens[1].logprob is None and tokens[1].top is None
    assert tokens[2].top == []
    assert tokens[2].logprob == pytest.approx(float(expected[2].max()), abs=1e-5)


def test_row_count_mismatch_raises() -> None:
    with pytest.raises(ValueError):
        Sampler().sample(random_logits(2), [make_request()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_max_is_argmax_on_ties_nans_and_signed_zeros(dtype: torch.dtype) -> None:
    """bf16 logits go to the native kernel where it is built (`native.serves`): the same
    index as argmax over their float32 values, at 1 and 2 threads and any row length."""
    native.load()
    generator = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            for rows, width in ((1, 4099), (3, 4099), (64, 4099), (2, 7), (5, 16), (4, 49152)):
                # few distinct values: every row has many tied maxima
                values = torch.randint(-3, 4, (rows, width), generator=generator).to(dtype)
                zeros = values == 0
                values[zeros & (torch.rand(values.shape, generator=generator) < 0.5)] = -0.0
                expected = values.float().argmax(dim=-1)
                assert torch.equal(first_max(values), expected)
                values[:, -1] = float("inf")  # the largest in the tail
                assert torch.equal(first_max(values), values.float().argmax(dim=-1))
                values[0, 1:] = float("-inf")  # a row of -inf but its first value
                assert torch.equal(first_max(values), values.float().argmax(dim=-1))
                values[torch.rand(values.shape, generator=generator) < 0.001] = float("nan")
                values[-1, -1] = float("nan")
                assert torch.equal(first_max(values), values.float().argmax(dim=-1))
    finally:
        torch.set_num_threads(threads)


def test_first_max_on_bf16_reads_the_native_kernel_where_built() -> None:
    if not (native.load() and native.bf16()):
        pytest.skip("no AVX512-BF16 native kernels on this CPU")
    values = torch.randn(8, 1000).to(torch.bfloat16)
    assert torch.equal(torch.ops.ladle_native.first_max_bf16(values), values.float().argmax(dim=-1))
    assert torch.equal(
        torch.ops.ladle_native.first_max_bf16(torch.full((2, 33), float("-inf")).bfloat16()),
        torch.zeros(2, dtype=torch.long),
    )

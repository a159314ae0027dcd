"""Our paged-KV executor against transformers' forward and generate on tiny random models."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.engines import TEST_DEVICE
from tests.support.tiny_models import (
    FAMILIES,
    ArgmaxSampler,
    ManualBatch,
    make_request,
    reference_model,
    tiny_model_dir,
)
from worker.engine.core.outputs import SchedulerOutput
from worker.engine.model_runner import ModelRunner
from worker.layers.rotary import compute_inv_freq, rope_parameters
from worker.models.loader import LoadedModel, load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: tiny_model_dir(family, root) for family in FAMILIES}


@pytest.fixture(scope="module")
def loaded(model_dirs) -> dict[str, LoadedModel]:
    return {
        f: load_model(str(d), dtype="float32", device=TEST_DEVICE) for f, d in model_dirs.items()
    }


@pytest.fixture(scope="module")
def references(model_dirs) -> dict:
    return {f: reference_model(d) for f, d in model_dirs.items()}


def _shuffled_blocks(seed: int = 0) -> list[int]:
    blocks = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(blocks)
    return blocks


def _runner(loaded_model: LoadedModel) -> ModelRunner:
    return ModelRunner(loaded_model, NUM_BLOCKS, BLOCK_SIZE, ArgmaxSampler())


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.cpu(), expected, atol=ATOL, rtol=0)


@torch.no_grad()
def _reference_logits(reference, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of `token_ids` [len, vocab]."""
    return reference(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family, loaded, references):
    runner = _runner(loaded[family])
    batch = ManualBatch(BLOCK_SIZE, _shuffled_blocks())
    prompts = [_prompt(n, seed=n) for n in (1, 13, 40)]
    requests = [make_request(f"r{i}", p) for i, p in enumerate(prompts)]
    logits = runner.compute_logits(batch.step([batch.chunk(r, r.num_tokens) for r in requests]))
    assert logits.dtype == torch.float32 and logits.shape == (3, 256)
    for row, prompt in enumerate(prompts):
        expected = _reference_logits(references[family], prompt)[-1]
        _close(logits[row], expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_then_decode_matches_full_forward(family, loaded, references):
    runner = _runner(loaded[family])
    batch = ManualBatch(BLOCK_SIZE, _shuffled_blocks(seed=1))
    request = make_request("a", _prompt(21, seed=7))
    for size in (5, 7):  # the third chunk (9 tokens) reaches the end and samples
        assert runner.compute_logits(batch.step([batch.chunk(request, size)])).shape[0] == 0
    all_logits = [runner.compute_logits(batch.step([batch.chunk(request, 9)]))[0]]
    for _ in range(5):
        request.append_output_token(int(all_logits[-1].argmax()))
        all_logits.append(runner.compute_logits(batch.step([batch.chunk(request, 1)]))[0])
    expected = _reference_logits(references[family], request.all_token_ids)
    assert batch.tables["a"] != sorted(batch.tables["a"])  # non-contiguous blocks
    _close(torch.stack(all_logits), expected[20:])


def _prefill_alone(runner: ModelRunner, batch: ManualBatch, request) -> int:
    logits = runner.compute_logits(batch.step([batch.chunk(request, request.num_tokens)]))
    return int(logits[0].argmax())


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_batch_matches_each_sequence_alone(family, loaded, references):
    runner = _runner(loaded[family])
    batch = ManualBatch(BLOCK_SIZE, _shuffled_blocks(seed=2))
    decoders = [make_request(f"d{i}", _prompt(n, seed=n)) for i, n in enumerate((3, 17, 30))]
    for request in decoders:
        request.append_output_token(_prefill_alone(runner, batch, request))
    fresh = make_request("fresh", _prompt(11, seed=11))
    partial = make_request("partial", _prompt(19, seed=19))
    runner.compute_logits(batch.step([batch.chunk(partial, 6)]))
    single = make_request("single", [42])  # a one-token prompt batches with the decodes
    chunks = [batch.chunk(r, 1) for r in [single, *decoders]]
    chunks += [batch.chunk(fresh, 11), batch.chunk(partial, 13)]
    mixed = runner.compute_logits(batch.step(chunks))
    assert mixed.shape == (6, 256)
    for row, request in enumerate([single, *decoders, fresh, partial]):
        alone_runner = _runner(loaded[family])
        alone_batch = ManualBatch(BLOCK_SIZE, list(range(NUM_BLOCKS)))
        alone = make_request("x", request.all_token_ids)
        alone_logits = alone_runner.compute_logits(
            alone_batch.step([alone_batch.chunk(alone, alone.num_tokens)])
        )[0]
        _close(mixed[row], alone_logits.cpu())
        expected = _reference_logits(references[family], request.all_token_ids)[-1]
        _close(mixed[row], expected)


def _greedy_with_runner(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list:
    """All prompts decoded together, continuous-batching style (decodes first)."""
    batch = ManualBatch(BLOCK_SIZE, _shuffled_blocks(seed=3))
    requests = [make_request(f"g{i}", p) for i, p in enumerate(prompts)]
    for _ in range(steps):
        decoding = [r for r in requests if r.num_output_tokens > 0]
        prefilling = [r for r in requests if r.num_output_tokens == 0]
        chunks = [batch.chunk(r, 1) for r in decoding]
        chunks += [batch.chunk(r, r.num_tokens) for r in prefilling]
        output = runner.execute(batch.step(chunks))
        for request in requests:
            request.append_output_token(output.sampled[request.request_id][0].token_id)
    return [r.output_token_ids for r in requests]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decode_equals_transformers_generate(family, loaded, references):
    reference = references[family]
    reference.generation_config.eos_token_id = None
    prompts = [_prompt(n, seed=100 + n) for n in (1, 6, 16, 29)]
    ours = _greedy_with_runner(_runner(loaded[family]), prompts, steps=16)
    for prompt, tokens in zip(prompts, ours, strict=True):
        generated = reference.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=16, pad_token_id=0
        )
        assert tokens == generated[0, len(prompt) :].tolist()


def test_release_forwards_to_sampler(loaded):
    runner = _runner(loaded["llama"])
    runner.release(["a", "b"])
    assert runner.sampler.released == ["a", "b"]
    assert runner.execute(SchedulerOutput()).sampled == {}


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_rope_scaling_matches_transformers(case, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_theta": 10000.0, **ROPE_CASES[case]}
    model_dir = tiny_model_dir("llama", tmp_path, rope_parameters=params)
    ours = load_model(str(model_dir), dtype="float32", device=TEST_DEVICE)
    config = ours.hf_config
    inv_freq, scale = compute_inv_freq(rope_parameters(config), 16, 512)
    expected_inv_freq, expected_scale = ROPE_INIT_FUNCTIONS[case](config, "cpu")
    torch.testing.assert_close(inv_freq, expected_inv_freq, atol=0, rtol=1e-6)
    assert scale == pytest.approx(expected_scale)
    runner = _runner(ours)
    batch = ManualBatch(BLOCK_SIZE, list(range(NUM_BLOCKS)))
    request = make_request("long", _prompt(300, seed=5))
    runner.compute_logits(batch.step([batch.chunk(request, 200)]))
    logits = runner.compute_logits(batch.step([batch.chunk(request, 100)]))[0]
    expected = _reference_logits(reference_model(model_dir), request.all_token_ids)[-1]
    _close(logits, expected)


def test_bfloat16_runs_close_to_float32(model_dirs, loaded):
    bf16 = load_model(str(model_dirs["llama"]), dtype="bfloat16", device=TEST_DEVICE)
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    prompt = _prompt(24, seed=9)
    results = []
    for loaded_model in (bf16, loaded["llama"]):
        batch = ManualBatch(BLOCK_SIZE, list(range(NUM_BLOCKS)))
        request = make_request("b", prompt)
        step = batch.step([batch.chunk(request, request.num_tokens)])
        results.append(_runner(loaded_model).compute_logits(step)[0])
    assert results[0].dtype == torch.float32
    assert (results[0] - results[1]).abs().max() < 0.1 * results[1].abs().max()

"""The CUDA-graph decode path's device-independent part: buckets, static inputs, padding.

`EagerReplay` re-runs the captured forward on the graph's static tensors, so everything but
the capture itself (bucketing, filling, padding rows into the scratch block, slicing the
output, picking sampling rows) is checked here against the plain eager runner.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from tests.engine.test_engine import GREEDY, hf_greedy, random_prompts, token_ids
from tests.support.engines import TEST_DEVICE, cpu_only, make_engine
from worker.engine.cuda_graphs import (
    DecodeGraphs,
    EagerReplay,
    batch_buckets,
    block_buckets,
)
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert block_buckets(1) == [1]
    assert block_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert block_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def with_eager_graphs(engine: LLMEngine, max_batch_size: int = 64) -> DecodeGraphs:
    runner = engine.executor.runner
    graphs = DecodeGraphs(
        runner.model,
        engine.config.block_size,
        engine.executor.max_model_len,
        max_batch_size,
        runner.scratch_block,
        runner.device,
        EagerReplay(),
    )
    runner.graphs = graphs
    return graphs


class CountingReplay(EagerReplay):
    def __init__(self) -> None:
        self.captures = 0
        self.replays = 0

    def capture(self, run):
        self.captures += 1
        run()

        def replay():
            self.replays += 1
            return run()

        return replay


def test_graph_decode_equals_eager_and_transformers(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(7, [1, 7, 16, 17, 40, 95, 3], seed=11)
    rng = random.Random(5)
    params = [GREEDY] * 3 + [
        replace(GREEDY, temperature=0.8, top_p=0.9, seed=i, max_tokens=rng.randint(3, 20))
        for i in range(4)
    ]
    eager = make_engine(model_dir, max_num_batched_tokens=64)
    graphed = make_engine(model_dir, max_num_batched_tokens=64)
    engines += [eager, graphed]
    graphs = with_eager_graphs(graphed)
    counter = graphs.backend = CountingReplay()

    expected = LLM(engine=eager).generate(prompts, params)
    got = LLM(engine=graphed).generate(prompts, params)
    assert token_ids(got) == token_ids(expected)
    assert token_ids(got)[:3] == hf_greedy(model_dir, prompts[:3], GREEDY.max_tokens)
    # Decode steps went through the graphs, at bucketed shapes only.
    assert counter.replays > 10 and counter.captures == len(graphs.graphs)
    for rows, blocks in graphs.graphs:
        assert rows in graphs.batch_buckets and blocks in graphs.block_buckets
    # The scratch block is outside the block manager's range.
    assert graphed.block_manager.num_blocks == graphed.executor.runner.scratch_block


class CheckedGraphs(DecodeGraphs):
    """Checks each replay writes layer 0's K only at the step's slots and the scratch block."""

    steps = 0

    def run(self, chunks):
        k_cache = self.model.model.layers[0].self_attn.attn.k_cache
        before = k_cache.clone()
        hidden = super().run(chunks)
        rows, _ = self.shape_for(chunks)
        changed = (k_cache != before).any(-1).any(0).nonzero().tolist()  # (block, offset)
        expected = {
            (c.block_ids[c.start_position // self.block_size], c.start_position % self.block_size)
            for c in chunks
        }
        if rows > len(chunks):
            expected.add((self.scratch_block, 0))
        assert {tuple(slot) for slot in changed} <= expected
        assert len(changed) >= len(chunks)
        CheckedGraphs.steps += 1
        return hidden


def test_padding_rows_write_only_the_scratch_block(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    engine = make_engine(tiny_model_dirs["qwen3"])
    engines.append(engine)
    runner = engine.executor.runner
    graphs = runner.graphs = CheckedGraphs(
        runner.model, 16, 512, 64, runner.scratch_block, runner.device, EagerReplay()
    )
    prompts = random_prompts(3, [20, 5, 33], seed=2)  # 3 rows pad to 4
    first = token_ids(LLM(engine=engine).generate(prompts, GREEDY))
    assert [rows for rows, _ in graphs.graphs] == [4]
    assert CheckedGraphs.steps == GREEDY.max_tokens - 1
    assert first == hf_greedy(tiny_model_dirs["qwen3"], prompts, GREEDY.max_tokens)


def test_steps_the_graphs_do_not_cover_run_eagerly(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    engine = make_engine(tiny_model_dirs["qwen2"], max_num_batched_tokens=64)
    engines.append(engine)
    graphs = with_eager_graphs(engine, max_batch_size=2)  # 3 sequences: too many rows
    prompts = random_prompts(3, [9, 14, 30], seed=4)
    eager = make_engine(tiny_model_dirs["qwen2"], max_num_batched_tokens=64)
    engines.append(eager)
    assert token_ids(LLM(engine=engine).generate(prompts, GREEDY)) == token_ids(
        LLM(engine=eager).generate(prompts, GREEDY)
    )
    assert graphs.graphs == {}


class FailingCapture(EagerReplay):
    def capture(self, run):
        raise RuntimeError("operation not permitted when stream is capturing")


def test_a_failed_capture_falls_back_to_eager(
    tiny_model_dirs: dict, engines: list[LLMEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(tiny_model_dirs["llama"])
    engines.append(engine)
    graphs = with_eager_graphs(engine)
    graphs.backend = FailingCapture()
    prompts = random_prompts(3, [9, 14, 30], seed=6)
    got = token_ids(LLM(engine=engine).generate(prompts, GREEDY))
    assert got == hf_greedy(tiny_model_dirs["llama"], prompts, GREEDY.max_tokens)
    assert engine.executor.runner.graphs is None
    assert "decode runs eagerly from now on" in caplog.text


@cpu_only
def test_cuda_graphs_stay_off_on_cpu(tiny_model_dirs: dict, engines: list[LLMEngine]) -> None:
    engine = make_engine(tiny_model_dirs["llama"], cuda_graphs=True)
    engines.append(engine)
    assert engine.executor.runner.graphs is None


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="needs LADLE_TEST_DEVICE=cuda and a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_real_cuda_graphs_equal_eager(
    tiny_model_dirs: dict, engines: list[LLMEngine], dtype: str
) -> None:
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(11, [1, 7, 16, 17, 40, 95, 3], seed=12)
    results = []
    for graphs in (False, True):
        engine = make_engine(model_dir, dtype=dtype, cuda_graphs=graphs, max_num_batched_tokens=64)
        engines.append(engine)
        assert (engine.executor.runner.graphs is not None) == graphs
        results.append(token_ids(LLM(engine=engine).generate(prompts, GREEDY)))
    assert results[0] == results[1]
    assert engine.executor.runner.graphs.graphs  # captured and replayed
    assert torch.cuda.is_available()

"""The compiled forward (inductor, CPU) against the eager one: same tokens, close logits.

Tiny 2-layer model, a few shapes (T = 1 decode, batched decode, prefill chunks); the compile
itself takes tens of seconds on a busy machine, once per test session (FX graph cache).
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.engine.test_engine import GREEDY, hf_greedy, random_prompts, token_ids
from tests.engine.test_step_overhead import _run_steps
from tests.support.engines import cpu_only, make_engine
from worker.engine.compiled import decoder_layers
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM

pytestmark = cpu_only


def test_compiled_forward_equals_eager(
    tiny_model_dirs: dict, engines: list[LLMEngine], caplog: pytest.LogCaptureFixture
) -> None:
    model_dir = tiny_model_dirs["qwen3"]  # q/k norms: the most ops between the matmuls
    previous = torch.get_num_threads()
    # Prefill on 2 threads, decode on 1: Dynamo guards on the thread count, so both must
    # have been compiled at start, or decode would run eagerly ("refused", logged).
    compiled = make_engine(
        model_dir,
        compile="on",
        linear_kernel="prepacked",
        max_num_batched_tokens=32,
        num_threads=2,
        decode_threads=1,
    )
    eager = make_engine(model_dir, linear_kernel="prepacked", max_num_batched_tokens=32)
    engines += [compiled, eager]
    assert compiled.executor.compiled and not eager.executor.compiled
    prompts = random_prompts(3, [9, 40, 1], seed=3)  # 40 tokens: two prefill chunks
    for batch in ([prompts[0]], prompts):  # T = 1 decode steps, then T >= 2
        got = token_ids(LLM(engine=compiled).generate(batch, GREEDY))
        assert got == token_ids(LLM(engine=eager).generate(batch, GREEDY))
    assert got == hf_greedy(model_dir, prompts, GREEDY.max_tokens)
    assert "refused" not in caplog.text
    torch.set_num_threads(previous)
    logits = [
        _run_steps(e.executor.runner, prompts, tag) for e, tag in ((compiled, "c"), (eager, "e"))
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def test_a_failing_compile_runs_eagerly(
    tiny_model_dirs: dict,
    engines: list[LLMEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def no_compiler(self: torch.nn.Module, *args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler here")

    monkeypatch.setattr(torch.nn.Module, "compile", no_compiler)
    with caplog.at_level(logging.ERROR, logger="worker.engine.compiled"):
        engine = make_engine(tiny_model_dirs["llama"], compile="on")
    engines.append(engine)
    assert not engine.executor.compiled and "no C++ compiler here" in caplog.text
    layers = decoder_layers(engine.executor.runner.model)
    assert layers and all(layer._compiled_call_impl is None for layer in layers)
    prompts = random_prompts(2, [5, 12], seed=1)
    got = token_ids(LLM(engine=engine).generate(prompts, GREEDY))
    assert got == hf_greedy(tiny_model_dirs["llama"], prompts, GREEDY.max_tokens)


def test_compile_off_is_eager(tiny_model_dirs: dict, engines: list[LLMEngine]) -> None:
    engine = make_engine(tiny_model_dirs["llama"], compile="off")
    engines.append(engine)
    runner = engine.executor.runner
    assert runner.compiled is None and runner.forward is runner.model

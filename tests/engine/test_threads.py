"""CPU thread use per step: every thread for prefill, fewer for decode-only steps."""

from __future__ import annotations

import pytest
import torch

from tests.support.engines import cpu_only, make_engine
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine

pytestmark = cpu_only


@pytest.fixture
def measured_engine(tiny_model_dirs: dict, engines: list[LLMEngine]):
    """A 2-thread engine whose decode threads are measured; torch's thread count restored."""
    before = torch.get_num_threads()
    engine = make_engine(tiny_model_dirs["llama"], num_threads=2)
    engines.append(engine)
    yield engine
    torch.set_num_threads(before)


def test_decode_only_steps_use_the_decode_threads(
    tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    before = torch.get_num_threads()
    try:
        engine = make_engine(tiny_model_dirs["llama"], num_threads=2, decode_threads=1)
        engines.append(engine)
        assert (engine.executor.num_threads, engine.executor.decode_threads) == (2, 1)
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        engine.add_request(engine.prepare("a", [5, 6, 7, 8], params))
        seen = []
        while engine.has_unfinished_requests():
            engine.step()
            seen.append(torch.get_num_threads())
        assert seen == [2, 1, 1]  # the prefill step, then two decode steps
    finally:
        torch.set_num_threads(before)


def test_decode_threads_default_to_all(tiny_model_dirs: dict, engines: list[LLMEngine]) -> None:
    before = torch.get_num_threads()
    try:
        engine = make_engine(tiny_model_dirs["llama"], num_threads=2)
        engines.append(engine)
        assert engine.executor.decode_threads == 2
    finally:
        torch.set_num_threads(before)


def test_measured_threads_are_chosen_per_kind_of_step_and_reported(
    measured_engine: LLMEngine,
) -> None:
    engine = measured_engine
    assert engine.executor.threads.options == [1, 2]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request(engine.prepare("a", [5, 6, 7, 8], params))
    while engine.has_unfinished_requests():
        engine.step()
    choices = engine.stats().step_threads
    decode = f"decode<={engine.executor.kernel_plan.bucket_for(1)}"
    assert set(choices) == {"prefill<=16", decode}  # the 4-token prompt's bucket
    assert all(threads in (1, 2) for threads in choices.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_new_decode_bucket_starts_where_the_nearest_one_settled(
    measured_engine: LLMEngine,
) -> None:
    executor = measured_engine.executor
    if executor.kernel_plan.threads_for(16) is not None:
        pytest.skip("the kernel plan timed the decode threads: its count comes first")
    chooser = executor.threads
    assert chooser.pick("decode<=1") == executor.decode_threads == 2  # the default
    for threads, seconds in [(2, 0.05)] * 3:
        chooser.record("decode<=1", threads, seconds)
    chooser._kinds["decode<=1"].choice = 1  # as a won probe leaves it
    assert chooser.pick("decode<=16") == 1
    assert chooser.pick("prefill<=16") == 2  # prefill: every thread


def test_prefill_steps_are_compared_by_size() -> None:
    from worker.engine.executor import prefill_kind

    assert [prefill_kind(n) for n in (1, 16, 17, 100, 1024, 1025)] == [
        "prefill<=16",
        "prefill<=16",
        "prefill<=32",
        "prefill<=128",
        "prefill<=1024",
        "prefill<=2048",
    ]

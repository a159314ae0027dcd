"""The decoder's layers as one native call (`worker/models/native_stack.py`): the same tokens
and logprobs, bit for bit, as the Python layer loop it replaces, and the loop kept where a
model does not qualify."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.support.engines import TEST_DEVICE, add_tiny_tokenizer, make_engine, require_native
from tests.support.tiny_models import tiny_model_dir
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM
from worker.layers import native
from worker.models import native_stack

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0),
    SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True, logprobs=0),
]


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(5, 70))] for _ in range(6)]


def _run(model_dir: Path, enabled: bool, monkeypatch, **settings: object) -> tuple:
    """(answers, the stack or None, the KV cache's dtype) of one engine's run."""
    build = native_stack.build_stack if enabled else (lambda layers: None)
    with monkeypatch.context() as patch:
        patch.setattr(native_stack, "build_stack", build)
        engine = make_engine(model_dir, linear_kernel="native", deterministic=True, **settings)
        params = [PARAMS[i % 2] for i in range(6)]
        results = LLM(engine=engine).generate(_prompts(), params)
    answers = [
        (tuple(o.token_ids), tuple(t.logprob for t in o.logprobs or []))
        for r in results
        for o in r.outputs
    ]
    executor = engine.executor
    return answers, executor.runner.model.model.native_layers._stack, executor.kernels["kv_cache"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "family,settings",
    [
        ("llama", {"num_threads": 2}),
        ("llama", {"num_threads": 1, "quantization": "int4", "int4_kernel": "avx512"}),
        ("llama", {"num_threads": 2, "quantization": "int4", "int4_kernel": "amx"}),
        ("llama", {"num_threads": 2, "quantization": "int4", "int4_kernel": "vnni"}),
        ("qwen2", {"num_threads": 2}),  # a bias on qkv
        ("llama", {"num_threads": 2, "kv_cache_dtype": "float16"}),  # float32 models only
    ],
)
def test_stack_gives_the_loops_answers(family, settings, dtype, tmp_path, monkeypatch) -> None:
    require_native(bf16=dtype == "bfloat16")
    if dtype == "float32" and "quantization" in settings and native.bf16():
        pytest.skip("int4 computes on bf16 activations where the bf16 kernels are")
    if dtype == "bfloat16" and "kv_cache_dtype" in settings:
        pytest.skip("a float16 KV cache serves float32 models")
    settings = {**settings, "dtype": dtype}
    if settings.get("int4_kernel") == "amx" and not native.int4_amx_usable(64, 128):
        pytest.skip("no AMX int4 kernel on this CPU")
    if settings.get("int4_kernel") == "vnni" and "vnni" not in native.int4_kernels_here():
        pytest.skip("no VNNI int4 kernel on this CPU")
    monkeypatch.setitem(native._state, "int4_kernel", native._state.get("int4_kernel"))
    path = tiny_model_dir(family, tmp_path, hidden_size=128, intermediate_size=256)
    add_tiny_tokenizer(path)
    looped, none, _ = _run(path, False, monkeypatch, **settings)
    stacked, stack, kv_dtype = _run(path, True, monkeypatch, **settings)
    assert none is None and stack is not None  # the second run went through the stack
    assert stacked == looped
    # a float16 cache where asked for, and by default under int4 on float32 activations
    half = dtype == "float32" and ("kv_cache_dtype" in settings or "quantization" in settings)
    assert kv_dtype == ("float16" if half else dtype)
    if "int4_kernel" in settings and dtype == "bfloat16":  # the kernel LLM_INT4_KERNEL named
        assert native.int4_kernel(64, 128) == settings["int4_kernel"]


def test_a_model_that_does_not_qualify_keeps_the_loop(tmp_path, monkeypatch) -> None:
    require_native(bf16=False)
    path = tiny_model_dir("gemma3", tmp_path, hidden_size=128, intermediate_size=256)
    add_tiny_tokenizer(path)
    _, stack, _ = _run(path, True, monkeypatch, num_threads=1, dtype="float32")
    assert stack is None  # sandwich norms, q/k norms, windows: the Python layers serve it

"""Same request, same answer: a greedy and a seeded request give the same tokens, and the same
logprobs bit for bit, alone, among 15 other requests, after a prefix-cache hit on their own
prompt, with a tiny prefill chunk, after preemption, on 1 or 2 threads and with n-gram
speculation, in bf16 (attention on vectors or AMX tiles), int4 and float32 (with a float16 KV
cache too) (the deterministic mode, `LLM_DETERMINISTIC`)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.engines import (
    TEST_DEVICE,
    add_tiny_tokenizer,
    assert_all_blocks_free,
    make_engine,
    require_native,
)
from tests.support.tiny_models import tiny_model_dir
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM
from worker.layers import native

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=0)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True, logprobs=0
)
# passage repeated: the continuation often quotes it, so n-gram drafts are proposed and kept
_rng = random.Random(3)
_PASSAGE = [_rng.randrange(3, 256) for _ in range(9)]
PROBE = [_rng.randrange(3, 256) for _ in range(21)] + _PASSAGE * 3
MODES = {
    "bf16": {"dtype": "bfloat16", "attention_kernel": "avx512"},
    "bf16, attention on AMX tiles": {"dtype": "bfloat16", "attention_kernel": "amx"},
    "int4": {"dtype": "bfloat16", "quantization": "int4"},
    "int4, int8 lm_head": {
        "dtype": "bfloat16",
        "quantization": "int4",
        "lm_head_quantization": "int8",
    },
    "float32": {"dtype": "float32"},
    "float32, float16 KV cache": {"dtype": "float32", "kv_cache_dtype": "float16"},
    "int4 on float32 (float16 KV cache)": {"dtype": "float32", "quantization": "int4"},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """head_dim 32, every shape a native kernel takes (as the default model's are)."""
    path = tiny_model_dir(
        "llama", tmp_path_factory.mktemp("determinism"), hidden_size=128, intermediate_size=256
    )
    add_tiny_tokenizer(path)
    require_native(bf16=False)
    return path


def _others(count: int, seed: int, longest: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(3, longest))] for _ in range(count)]


def _answers(engine, prompts: list[list[int]]) -> list[tuple]:
    """(token ids, logprobs) of the probe's greedy and seeded answers, given the prompts."""
    params = [GREEDY, SEEDED] + [GREEDY] * (len(prompts) - 2)
    results = LLM(engine=engine).generate(prompts, params)
    return [
        (tuple(o.token_ids), tuple(t.logprob for t in o.logprobs or []))
        for r in results[:2]
        for o in r.outputs
    ]


@pytest.mark.parametrize("mode", list(MODES))
def test_same_request_same_answer_in_every_situation(mode: str, model_dir: Path) -> None:
    settings = {**MODES[mode], "linear_kernel": "native", "num_threads": 2, "deterministic": True}
    if settings["dtype"] == "bfloat16":
        require_native(bf16=True)
    if settings["dtype"] == "float32" and "quantization" in settings and native.bf16():
        pytest.skip("int4 computes on bf16 activations where the bf16 kernels are")
    if "lm_head_quantization" in settings and not native.int8_packable(16, 32):
        pytest.skip("the int8 kernel needs AVX512-VNNI")
    tiles = settings.get("attention_kernel") == "amx"
    if tiles and not native.attention_tiles_usable():
        pytest.skip("the tile attention kernel needs AMX")

    def engine(**extra: object):
        built = make_engine(model_dir, **{**settings, **extra})
        assert built.executor.deterministic, built.executor.deterministic_reason
        if "lm_head_quantization" in settings:  # the mode must really run the int8 kernel
            assert built.executor.loaded.model.lm_head.quantized.name == "int8-native"
        if settings["dtype"] == "float32":  # float16 where asked for, or by auto under int4
            half = "kv_cache_dtype" in settings or "quantization" in settings
            assert built.executor.kernels["kv_cache"] == ("float16" if half else "float32")
        if "attention_kernel" in settings:  # and the attention kernel it names
            layers = [m for m in built.executor.loaded.model.modules() if hasattr(m, "tiles")]
            assert layers and all(layer.tiles == tiles for layer in layers)
        return built

    base = engine()
    alone = _answers(base, [PROBE, PROBE])
    situations = {
        "prefix cache hit": lambda: _answers(base, [PROBE, PROBE]),
        "among 15 others": lambda: _answers(base, [PROBE, PROBE, *_others(14, seed=4)]),
    }
    chunked = engine(max_num_batched_tokens=5)
    situations["prefill chunks of 5"] = lambda: _answers(chunked, [PROBE, PROBE, *_others(3, 5)])
    tight = engine(kv_cache_size_mb=1, max_num_seqs=16)  # 128 blocks: too few for all 16
    situations["preempted"] = lambda: _answers(tight, [PROBE, PROBE, *_others(14, 6, 240)])
    one_thread = engine(num_threads=1)
    situations["one thread"] = lambda: _answers(one_thread, [PROBE, PROBE])
    speculating = engine(speculative_ngram=3)
    situations["n-gram speculation"] = lambda: _answers(speculating, [PROBE, PROBE, *_others(3, 7)])
    for name, run in situations.items():
        assert run() == alone, name
    torch.set_num_threads(2)
    assert base.stats().num_prefix_hit_tokens > 0
    assert tight.stats().num_preemptions_total > 0
    assert speculating.stats().num_spec_accepted_tokens > 0
    for built in (base, chunked, tight, one_thread, speculating):
        assert_all_blocks_free(built)


def test_worker_record_says_which_mode_runs(model_dir: Path) -> None:
    dtype = "bfloat16" if native.bf16() else "float32"  # float32 alone where only AVX2 builds
    on = make_engine(model_dir, dtype=dtype, linear_kernel="native", deterministic=True)
    assert on.executor.deterministic and on.executor.deterministic_reason == ""
    off = make_engine(model_dir, dtype=dtype, linear_kernel="plain", deterministic=False)
    assert not off.executor.deterministic
    assert off.executor.deterministic_reason == "LLM_DETERMINISTIC=false"
    plain = make_engine(model_dir, dtype=dtype, linear_kernel="plain", deterministic=True)
    assert (
        not plain.executor.deterministic
        and "batch-invariant" in plain.executor.deterministic_reason
    )

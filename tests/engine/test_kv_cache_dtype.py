"""A float16 KV cache for float32 models (`LLM_KV_CACHE_DTYPE`): the row kernel over it gives
the float32 kernel's bits over the same rounded cache, `write_kv` rounds as torch does, and
the engine picks it where the setting says (auto: under quantized projections only)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.support.engines import TEST_DEVICE, add_tiny_tokenizer, make_engine, require_native
from tests.support.tiny_models import tiny_model_dir
from worker.layers import native

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def loaded_native():
    require_native(bf16=False)  # the float32 kernels (and float16 caches) build for AVX2 too


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 1, 256)])
@pytest.mark.parametrize("softcap,window", [(None, None), (5.0, 9)])
def test_rows_over_a_float16_cache_are_the_float32_kernels_over_it(
    heads, kv_heads, head_dim, packed, softcap, window
):
    block_size, num_blocks, rows = 16, 40, 6
    rng = random.Random(head_dim)
    k_half = _rand(kv_heads, num_blocks, block_size, head_dim, seed=1).half()
    v_half = _rand(kv_heads, num_blocks, block_size, head_dim, seed=2).half()
    lens = torch.tensor([1, 16, 17, 200, 319, 320])
    tables = torch.tensor([rng.sample(range(num_blocks), 20) for _ in range(rows)])
    starts = (lens - window).clamp(min=0) if window else None
    q = _rand(rows, heads, head_dim, seed=3) * 3

    def attend(k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        keys = native.pack_keys(k_cache) if packed else k_cache
        return native.attention_rows(
            q, keys, v_cache, tables, lens, head_dim**-0.5, starts, softcap, packed
        )

    got = attend(k_half, v_half)
    assert got.dtype == torch.float32
    assert torch.equal(got, attend(k_half.float(), v_half.float()))


@pytest.mark.parametrize("packed", [False, True])
def test_write_kv_rounds_float32_into_a_float16_cache(packed):
    k_cache = torch.zeros(3, 10, 16, 64, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    qkv = _rand(5, 9 + 6, 64, seed=4) * 1000  # some values far from float16's steps
    k, v = qkv[:, 9:12], qkv[:, 12:]  # strided, as they come out of a fused qkv
    slots = torch.tensor([0, 17, 159, 64, 3])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(3, -1, 64).index_copy_(1, slots, k.transpose(0, 1).half())
    expected_v.view(3, -1, 64).index_copy_(1, slots, v.transpose(0, 1).half())
    torch.ops.ladle_native.write_kv(k, v, k_cache, v_cache, slots, packed)
    assert torch.equal(k_cache, native.pack_keys(expected_k) if packed else expected_k)
    assert torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="float32 for a float16 cache"):
        torch.ops.ladle_native.write_kv(k.half(), v.half(), k_cache, v_cache, slots)
    with pytest.raises(RuntimeError, match="float32 for a float16 cache"):
        native.attention_rows(
            _rand(2, 6, 64, seed=5).half(),
            k_cache,
            v_cache,
            torch.zeros(2, 1, dtype=torch.long),
            torch.tensor([1, 2]),
            0.125,
        )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tiny_model_dir(
        "llama", tmp_path_factory.mktemp("kv16"), hidden_size=128, intermediate_size=256
    )
    add_tiny_tokenizer(path)
    return path


def _engine(model_dir: Path, **settings: object):
    return make_engine(
        model_dir, dtype="float32", linear_kernel="native", deterministic=True, **settings
    )


def test_auto_keeps_float32_parity_and_halves_quantized_models_caches(model_dir):
    plain = _engine(model_dir)
    assert plain.executor.kernels["kv_cache"] == "float32"  # float32 asked for: its parity
    half = _engine(model_dir, kv_cache_dtype="float16")
    assert half.executor.kernels["kv_cache"] == "float16"
    # the same megabytes hold twice the blocks
    assert half.executor.num_blocks == 2 * plain.executor.num_blocks
    layers = half.executor.runner.kv_cache.k_caches
    assert all(t.dtype == torch.float16 for t in layers)
    if native.bf16():
        return  # int4 computes on bf16 activations there: no float32 int4 model to build
    quantized = _engine(model_dir, quantization="int4")
    assert quantized.executor.kernels["kv_cache"] == "float16"
    kept = _engine(model_dir, quantization="int4", kv_cache_dtype="model")
    assert kept.executor.kernels["kv_cache"] == "float32"


def test_float16_is_refused_where_the_row_kernel_does_not_read_it(model_dir):
    with pytest.raises(ValueError, match="LLM_KV_CACHE_DTYPE=float16 needs"):
        make_engine(
            model_dir,
            dtype="float32",
            linear_kernel="native",
            deterministic=False,
            kv_cache_dtype="float16",
        )
    with pytest.raises(ValueError, match="LLM_KV_CACHE_DTYPE=float16 needs"):
        _engine(model_dir, native_kernels=False, kv_cache_dtype="float16")

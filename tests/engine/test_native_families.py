"""The native kernels of the non-Llama families: Gemma's (1 + w) RMSNorm, GeGLU, and every
family's bf16 forward on them (no family left on the eager forward where Llama is native).

Skipped where the kernels cannot be built here (no g++ or no AVX512-BF16).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_batch_invariance import assert_rows_invariant
from tests.support.engines import TEST_DEVICE, require_native
from tests.support.tiny_models import FAMILIES, greedy_logits, tiny_model_dir
from worker.layers.activation import GeluTanhAndMul, SiluAndMul
from worker.layers.norm import RMSNorm
from worker.models.loader import load_model

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def loaded_native():
    require_native()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("size", [64, 640, 100])  # 100: a masked tail
def test_gemma_norm_matches_eager(size):
    norm = RMSNorm(size, 1e-6, offset=1.0).to(torch.bfloat16)
    norm.weight.data = _bf16(size, seed=7) * 0.5
    x, residual = _bf16(5, size, seed=8) * 3, _bf16(5, size, seed=9)
    got = torch.ops.ladle_native.rms_norm_bf16(x, norm.weight, norm.eps, 1.0)
    # one rounding, as eager's float32 product; the sum of squares in another order
    torch.testing.assert_close(got, norm(x), rtol=2**-7, atol=1e-3)
    normed, summed = torch.ops.ladle_native.add_rms_norm_bf16(
        x, residual, norm.weight, norm.eps, 1.0
    )
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, norm(x + residual), rtol=2**-7, atol=1e-3)
    # the offset is Gemma's, not Llama's: without it the result differs
    assert not torch.equal(got, torch.ops.ladle_native.rms_norm_bf16(x, norm.weight, norm.eps))


@pytest.mark.parametrize("size", [128, 2048, 40])
def test_gelu_tanh_mul_matches_eager(size):
    x = _bf16(3, 2 * size, seed=10) * 4  # reaches the tails where tanh saturates
    got = torch.ops.ladle_native.gelu_tanh_mul_bf16(x)
    expected = GeluTanhAndMul()(x)
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)
    # bit for bit but in the far negative tail (|value| < 1e-4), where eager's tanh differs
    assert (got == expected).float().mean() > 0.95


def test_family_ops_are_batch_invariant():
    ops = torch.ops.ladle_native
    weight = _bf16(640, seed=20)
    probe, filler = _bf16(640, seed=21), _bf16(256, 640, seed=22)
    assert_rows_invariant(lambda x: ops.rms_norm_bf16(x, weight, 1e-6, 1.0), probe, filler)
    assert_rows_invariant(ops.gelu_tanh_mul_bf16, _bf16(4096, seed=23), _bf16(256, 4096, seed=24))


def test_blocks_choose_native_for_bf16_and_float32_only():
    act, norm = GeluTanhAndMul(), RMSNorm(64, offset=1.0)
    norm.to(torch.float16).use_native(True)
    assert not norm.native  # no float16 kernels: eager
    norm.to(torch.float32).use_native(True)
    assert norm.native
    norm.to(torch.bfloat16).use_native(True)
    act.use_native(True)
    assert norm.native and act.native and not SiluAndMul.native


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("llama", "qwen2")])
def test_every_family_runs_the_native_forward(family, tmp_path):
    """bf16 with the native kernels: the forward is native and agrees with the eager one."""
    path = tiny_model_dir(family, tmp_path, hidden_size=64, intermediate_size=128)
    loaded = load_model(str(path), dtype="bfloat16", device="cpu")
    prompt = [random.Random(12).randrange(3, 256) for _ in range(30)]
    native_logits = greedy_logits(loaded, True, prompt, steps=4)
    eager_logits = greedy_logits(loaded, False, prompt, steps=4)
    scale = eager_logits.abs().max()
    assert (native_logits - eager_logits).abs().max() < 0.1 * scale
    agree = (native_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean()
    assert agree >= 0.8  # bf16 near-ties of a random tiny model may tip

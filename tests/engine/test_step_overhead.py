"""The per-step speedups keep results bitwise: fused RMSNorm, one-flip rotary, prepacked
oneDNN linears (bf16 on CPU) against the op-by-op formulas and plain F.linear."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.tiny_models import ArgmaxSampler, ManualBatch, make_request, tiny_model_dir
from worker.engine.autotune import choose_kernels
from worker.engine.model_runner import ModelRunner
from worker.layers.linear import Linear, PackedLinear
from worker.layers.linear_kernels import build_kernel
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, apply_rotary
from worker.models.loader import load_model

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_bitwise_the_reference_formula(dtype):
    generator = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(96, generator=generator))
    norm = norm.to(dtype)
    x = (3 * torch.randn(7, 96, generator=generator)).to(dtype)
    assert torch.equal(norm(x), _reference_rms_norm(x, norm.weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_is_bitwise_hf_rotate_half(dtype):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rotary = RotaryEmbedding(params, head_dim=32, max_positions=64)
    rotary.build_cache()
    rotary = rotary.to(dtype)
    positions = torch.tensor([0, 5, 63, 17])
    cos, signed_sin = rotary(positions)
    # HF's sin is the signed one with its first half negated back.
    sin = torch.cat((-signed_sin[..., :16], signed_sin[..., 16:]), dim=-1)
    qkv = torch.randn(4, 9, 32).to(dtype)
    x = qkv[:, 2:8]  # a strided view, as the q|k heads of a fused qkv are
    expected = x * cos + _rotate_half(x) * sin
    assert torch.equal(apply_rotary(x, cos, signed_sin), expected)


def _prepacked(module: Linear) -> Linear:
    kernel = build_kernel("prepacked", module.weight, module.bias)
    if kernel is None:
        pytest.skip("oneDNN prepacking not available here")
    module.set_kernel(kernel)
    return module


@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_is_bitwise_f_linear(bias):
    torch.manual_seed(0)
    linear = Linear(80, 200, bias=bias).to(torch.bfloat16)
    _prepacked(linear)
    for rows in (1, 2, 3, 7, 17, 64, 130):
        x = torch.randn(rows, 80).to(torch.bfloat16)
        assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias)), rows
    x3 = torch.randn(2, 5, 80).to(torch.bfloat16)  # not 2-D: plain F.linear
    assert torch.equal(linear(x3), F.linear(x3, linear.weight, linear.bias))


def test_float32_kernel_only_widens_narrower_weights():
    linear = PackedLinear(16, [8, 8])
    assert build_kernel("float32", linear.weight, linear.bias) is None
    narrow = Linear(16, 8, bias=True).to(torch.bfloat16)
    kernel = build_kernel("float32", narrow.weight, narrow.bias)
    x = torch.randn(3, 16).to(torch.bfloat16)
    expected = F.linear(x.float(), narrow.weight.float(), narrow.bias.float()).to(torch.bfloat16)
    assert kernel(x).dtype == torch.bfloat16 and torch.equal(kernel(x), expected)


def _run_steps(runner: ModelRunner, prompts: list[list[int]], tag: str) -> torch.Tensor:
    """Prefill every prompt in one step, then 4 batched decode steps: stacked logits."""
    blocks = list(range(runner.kv_cache.num_blocks))
    random.Random(3).shuffle(blocks)
    batch = ManualBatch(4, blocks)
    requests = [make_request(f"{tag}{i}", p) for i, p in enumerate(prompts)]
    logits = [runner.compute_logits(batch.step([batch.chunk(r, r.num_tokens) for r in requests]))]
    for _ in range(4):
        for request, row in zip(requests, logits[-1], strict=True):
            request.append_output_token(int(row.argmax()))
        logits.append(runner.compute_logits(batch.step([batch.chunk(r, 1) for r in requests])))
    return torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_bf16_runner_with_prepacked_linears_matches_plain(family, tmp_path):
    loaded = load_model(str(tiny_model_dir(family, tmp_path)), dtype="bfloat16", device="cpu")
    runner = ModelRunner(loaded, 64, 4, ArgmaxSampler())
    if build_kernel("prepacked", torch.zeros(2, 2, dtype=torch.bfloat16), None) is None:
        pytest.skip("oneDNN bf16 prepacking not available here")
    choose_kernels(loaded.model, "prepacked", max_num_seqs=4, max_threads=1)
    linears = [m for m in loaded.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * 2 + 1
    assert all(m.kernel is not None and m.kernel.name == "prepacked" for m in linears)
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((3, 11, 6))]
    packed = _run_steps(runner, prompts, "p")
    for module in linears:
        module.set_kernel(None)
    plain = _run_steps(runner, prompts, "q")
    assert torch.equal(packed, plain)

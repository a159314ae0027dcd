"""Ladle's native CPU kernels (worker/layers/native) against the eager code they replace.

Each op is checked against the eager bf16 computation (or a float32 reference where the op
accumulates in float32), then the whole bf16 forward with and without them, and the engine
end to end. Skipped where the kernels cannot be built here (no g++ or no AVX512-BF16); the
AMX cases also need a CPU with AMX.
"""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.engines import (
    TEST_DEVICE,
    add_tiny_tokenizer,
    assert_all_blocks_free,
    require_native,
)
from tests.support.engines import make_engine as make_test_engine
from tests.support.q8 import q8_activations, q8_rounded
from tests.support.tiny_models import greedy_logits, tiny_model_dir
from worker.engine.core.sampling_params import SamplingParams
from worker.layers import native
from worker.layers.activation import GeluTanhAndMul, SiluAndMul
from worker.layers.attention import AttentionOptions, _decode_eager
from worker.layers.context import AttentionMetadata
from worker.layers.linear_kernels import build_kernel
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding, apply_rotary
from worker.models.loader import load_model

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def loaded_native():
    require_native(bf16=False)  # the float32 matmul and attention build for AVX2 too
    previous = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernels split work over threads: cover the split
    yield
    torch.set_num_threads(previous)


# the tests of the bf16, int4 and int8 kernels and the fused small ops: AVX512-BF16 only
bf16_only = pytest.mark.bf16_kernels


@pytest.fixture(autouse=True)
def _bf16_kernels(request):
    if request.node.get_closest_marker("bf16_kernels"):
        require_native(bf16=True)


def _bf16(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@bf16_only
@pytest.mark.parametrize("name", ["native", "amx"])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (960, 576), (192, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemm_matches_float32_product(name, out_features, in_features, bias):
    weight = _bf16(out_features, in_features, seed=1)
    b = _bf16(out_features, seed=2) if bias else None
    kernel = build_kernel(name, weight, b)
    if kernel is None:
        assert name == "amx" and not native.amx_usable(out_features, in_features)
        pytest.skip("no AMX for this shape or CPU")
    for rows in (1, 2, 3, 8, 15, 16, 17, 40):
        x = _bf16(rows, in_features, seed=rows)
        expected = x.float() @ weight.float().T + (b.float() if bias else 0)
        got = kernel(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        # float32 sums rounded once to bf16: within bf16's half-ulp of the exact product
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-2)


@bf16_only
def test_unpackable_shapes_are_not_offered():
    assert build_kernel("native", _bf16(65, 32), None) is None  # rows not a multiple of 16
    assert build_kernel("native", _bf16(64, 33), None) is None  # bf16 needs input pairs
    assert build_kernel("amx", torch.randn(64, 32), None) is None  # AMX is bf16 only


@pytest.mark.parametrize("out_features,in_features,bias", [(64, 32, False), (960, 577, True)])
def test_float32_gemm_matches_float64_product(out_features, in_features, bias):
    weight = torch.randn(out_features, in_features) * 0.05
    b = torch.randn(out_features) if bias else None
    kernel = build_kernel("native", weight, b)
    assert kernel is not None
    for rows in (1, 3, 8, 17):
        x = torch.randn(rows, in_features)
        expected = x.double() @ weight.double().T + (b.double() if bias else 0)
        torch.testing.assert_close(kernel(x).double(), expected, rtol=1e-5, atol=1e-5)


@bf16_only
@pytest.mark.parametrize("which", ["avx512", "vnni", "amx"])
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (960, 576), (192, 1536)])
def test_int4_matches_the_dequantized_weight(out_features, in_features, which, monkeypatch):
    from worker.layers.quant import INT4_NAMES, Int4Kernel, quantize_int4

    if which not in native.int4_kernels_here():
        pytest.skip(f"no {which} int4 kernel on this CPU")
    if which == "amx" and not native.int4_amx_usable(out_features, in_features):
        pytest.skip("not a shape the AMX int4 kernel takes")
    monkeypatch.setitem(native._state, "int4_kernel", which)
    weight = quantize_int4(torch.randn(out_features, in_features))
    kernel = Int4Kernel(weight, None)
    assert kernel.native_packed is not None and kernel.native_kernel == which
    assert kernel.name == INT4_NAMES[which] and kernel.amx == (which == "amx")
    # the native kernel holds the float32 scales and mins themselves: w = q s + m
    dequantized = weight.dequantize()
    for rows in (1, 2, 7, 16, 17, 33, 150):
        x = _bf16(rows, in_features, seed=rows)
        expected = (q8_rounded(x) if which == "vnni" else x.float()) @ dequantized.T
        # one bf16 rounding of the output (and of the sums' order) at the outputs' scale
        atol = 2**-7 * float(expected.abs().max())
        torch.testing.assert_close(kernel(x).float(), expected, rtol=2**-7, atol=atol)


def _not_half(t: torch.Tensor) -> torch.Tensor:
    """`t` nudged by one float32 ulp: no longer a float16 (a Q4_K group's d * sc often is not)."""
    return torch.nextafter(t, torch.full_like(t, float("inf")))


def test_int4_packs_float16_scales_only_where_exact():
    from worker.layers.quant import quantize_int4

    weight = quantize_int4(torch.randn(64, 96))
    half = native.pack_int4(weight.values, weight.scales, weight.mins)
    assert half.shape == (4, 3, 320)  # our own int4 keeps its scales and mins in float16
    full = native.pack_int4(weight.values, _not_half(weight.scales), weight.mins)
    assert full.shape == (4, 3, 384)
    assert native.pack_int4(weight.values, weight.scales, _not_half(weight.mins)).shape[2] == 384
    huge = native.pack_int4(weight.values, weight.scales * 1e6, weight.mins)
    assert huge.shape[2] == 384  # past float16's range


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (960, 576), (208, 1536)])
def test_int4_layouts_give_the_same_bits(out_features, in_features, monkeypatch):
    """float16 or float32 scales and mins in the packed weight: the same float32 values in
    the kernel, so the same outputs to the bit, on bf16 and on float32 activations."""
    from worker.layers.quant import quantize_int4

    weight = quantize_int4(torch.randn(out_features, in_features))
    half = native.pack_int4(weight.values, weight.scales, weight.mins)
    half_q8 = native.pack_int4_q8(weight.values, weight.scales, weight.mins)
    monkeypatch.setattr(native, "is_half_exact", lambda t: False)  # float32 layout, same values
    full = native.pack_int4(weight.values, weight.scales, weight.mins)
    full_q8 = native.pack_int4_q8(weight.values, weight.scales, weight.mins)
    assert half.shape[2] == half_q8.shape[2] == 320 and full.shape[2] == full_q8.shape[2] == 384
    ops = torch.ops.ladle_native
    for rows in (1, 2, 7, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        if native.bf16():
            xb = x.to(torch.bfloat16)
            for amx in (False, True) if native.int4_amx_usable(out_features, in_features) else ():
                got = ops.gemm_int4(xb, half, out_features, None, amx)
                assert torch.equal(got, ops.gemm_int4(xb, full, out_features, None, amx))
            got = ops.gemm_int4(xb, half, out_features, None)
            assert torch.equal(got, ops.gemm_int4(xb, full, out_features, None))
        if "vnni" in native.int4_kernels_here():
            got = ops.gemm_int4_q8(xb, half_q8, out_features, None)
            assert torch.equal(got, ops.gemm_int4_q8(xb, full_q8, out_features, None))
            # the AVX2 kernel's exact integer sums and float32 steps, on the same bf16 x
            float32 = ops.gemm_int4_f32(xb.float(), half_q8, out_features, None)
            assert torch.equal(got, float32.to(torch.bfloat16))
        got = ops.gemm_int4_f32(x, half_q8, out_features, None)
        assert torch.equal(got, ops.gemm_int4_f32(x, full_q8, out_features, None))


@pytest.fixture
def prefetch_level_kept():
    """The process's prefetch level, put back after the test."""
    before = torch.ops.ladle_native.set_prefetch_level(1)
    yield
    torch.ops.ladle_native.set_prefetch_level(before)


@pytest.mark.usefixtures("prefetch_level_kept")
def test_prefetch_level_is_measured_once_and_changes_no_bits(tmp_path, monkeypatch):
    """The level is measured on first load and kept beside the library; either level gives
    the same outputs of the int4 kernels and the row attention (a prefetch only changes when
    weights and cached keys arrive)."""
    from worker.layers.quant import quantize_int4

    ops = torch.ops.ladle_native
    monkeypatch.setattr(native, "_probe_bytes", lambda: 8 << 20)
    library = tmp_path / "ladle_native-test.so"
    level = native.choose_prefetch_level(library)
    record = tmp_path / "ladle_native-test.prefetch.json"
    assert level in (0, 1) and record.exists()
    record.write_text('{"level": 0}')  # a kept record is used as it is, not measured again
    monkeypatch.setattr(native, "measure_prefetch_levels", lambda: pytest.fail("measured"))
    assert native.choose_prefetch_level(library) == 0
    with pytest.raises(RuntimeError, match="prefetch level"):
        ops.set_prefetch_level(2)
    weight = quantize_int4(torch.randn(960, 576))
    packed = native.pack_int4(weight.values, weight.scales, weight.mins)
    packed_q8 = native.pack_int4_q8(weight.values, weight.scales, weight.mins)
    x = torch.randn(1, 576)
    dtype = torch.bfloat16 if native.bf16() else torch.float32
    q, k_cache, v_cache, meta = _decode_case(5, 9, 3, 64, 11, dtype)  # scattered blocks
    rows = (meta.decode_block_tables, meta.decode_context_lens, 0.125)
    outputs = []
    for level in (0, 1):
        ops.set_prefetch_level(level)
        outputs.append(ops.gemm_int4_f32(x, packed_q8, 960, None))
        if native.bf16():
            outputs.append(ops.gemm_int4(x.to(torch.bfloat16), packed, 960, None))
        if "vnni" in native.int4_kernels_here():
            outputs.append(ops.gemm_int4_q8(x.to(torch.bfloat16), packed_q8, 960, None))
        outputs.append(native.attention_rows(q, k_cache, v_cache, *rows))
        keys = native.pack_keys(k_cache)
        outputs.append(native.attention_rows(q, keys, v_cache, *rows, packed_keys=True))
    half = len(outputs) // 2
    assert all(torch.equal(a, b) for a, b in zip(outputs[:half], outputs[half:], strict=True))


def test_int4_kernel_is_measured_once_where_the_cpu_has_several(tmp_path, monkeypatch):
    """Where the CPU has more than one bf16 int4 kernel (vdpbf16ps, VNNI, AMX) each is timed
    on first load and the choice kept beside the library; elsewhere nothing is timed and
    layers keep the `vdpbf16ps` one."""
    library = tmp_path / "ladle_native-test.so"
    record = tmp_path / "ladle_native-test.int4.json"
    here = native.int4_kernels_here()
    if len(here) < 2:
        monkeypatch.setattr(native, "measure_int4_kernels", lambda: pytest.fail("measured"))
        assert native.choose_int4_kernel(library) == "avx512" and not record.exists()
        return
    monkeypatch.setattr(native, "INT4_PROBE_ROWS", (1, 16))
    chosen = native.choose_int4_kernel(library)
    kept = json.loads(record.read_text())
    assert kept["kernel"] == chosen and set(kept["seconds"]) == set(here)
    assert set(kept["seconds"][chosen]) == {"1", "16"}
    monkeypatch.setattr(native, "measure_int4_kernels", lambda: pytest.fail("measured"))
    for kernel in here:  # a kept choice is used as it is
        record.write_text(json.dumps({"kernel": kernel}))
        assert native.choose_int4_kernel(library) == kernel
    monkeypatch.setitem(native._state, "int4_kernel", "amx")
    if "amx" in here:
        assert native.int4_kernel(960, 576) == "amx"
    assert native.int4_kernel(208, 576) == "avx512"  # the tiles take 64 outputs a set


def test_attention_kernel_is_measured_once_where_the_cpu_has_amx(tmp_path, monkeypatch):
    """Where the tile attention runs, both attention kernels are timed on first load and the
    choice is kept beside the library; elsewhere nothing is timed; LLM_ATTENTION_KERNEL names
    one, auto brings the measured one back."""
    library = tmp_path / "ladle_native-test.so"
    record = tmp_path / "ladle_native-test.attention.json"
    monkeypatch.setitem(native._state, "attention_tiles", native._state.get("attention_tiles"))
    if not native.attention_tiles_usable():
        monkeypatch.setattr(native, "measure_attention_kernels", lambda: pytest.fail("measured"))
        assert native.choose_attention_tiles(library) is False and not record.exists()
        native.select_attention_kernel("amx")
        assert not native.attention_tiles()
        return
    monkeypatch.setattr(native, "ATTENTION_PROBES", ((1, 32, False), (32, 32, True)))
    chosen = native.choose_attention_tiles(library)
    kept = json.loads(record.read_text())
    assert kept["kernel"] == ("amx" if chosen else "avx512")
    assert set(kept["seconds"]["amx"]) == {"decode 1x32", "prefill 32x32"}
    monkeypatch.setattr(native, "measure_attention_kernels", lambda: pytest.fail("measured"))
    for kernel in ("avx512", "amx"):  # a kept choice is used as it is
        record.write_text(json.dumps({"kernel": kernel}))
        assert native.choose_attention_tiles(library) is (kernel == "amx")
    monkeypatch.setitem(native._state, "attention_tiles_measured", True)
    native.select_attention_kernel("avx512")
    assert not native.attention_tiles()
    native.select_attention_kernel("auto")
    assert native.attention_tiles()


def test_llm_int4_kernel_names_the_kernel_and_auto_brings_the_measured_one_back(monkeypatch):
    from worker.layers.quant import Int4Kernel, quantize_int4

    monkeypatch.setitem(native._state, "int4_kernel", native._state.get("int4_kernel"))
    monkeypatch.setitem(native._state, "int4_kernel_measured", "vnni")
    weight = quantize_int4(torch.randn(960, 576))
    here = native.int4_kernels_here()
    for name in ("avx512", "vnni", "amx"):
        native.select_int4_kernel(name)
        kernel = Int4Kernel(weight, None)
        expected = name if name in here else "avx512"  # never a kernel the CPU lacks
        assert kernel.native_kernel == (expected if native.bf16() else "")
        assert kernel.amx == (expected == "amx" and native.bf16())
    native.select_int4_kernel("auto")
    assert native.int4_kernel(960, 576) == "vnni"


@bf16_only
def test_int4_amx_is_refused_where_it_does_not_apply():
    from worker.layers.quant import quantize_int4

    weight = quantize_int4(torch.randn(208, 576))  # 208 outputs: not whole sets of 64
    packed = native.pack_int4(weight.values, weight.scales, weight.mins)
    assert not native.int4_amx_usable(208, 576)
    with pytest.raises(RuntimeError, match="no AMX path"):
        torch.ops.ladle_native.gemm_int4(_bf16(1, 576, seed=1), packed, 208, None, True)


def _require_int8() -> None:
    if not native.int8_packable(16, 32):
        pytest.skip("the int8 kernel needs AVX512-VNNI")


@bf16_only
@pytest.mark.parametrize("out_features,in_features", [(64, 32), (4096, 576), (208, 1536)])
def test_grouped_int8_computes_the_q8_dot_products(out_features, in_features):
    from worker.layers.quant import GroupInt8Kernel, quantize_int8_groups

    _require_int8()
    weight = torch.randn(out_features, in_features)
    quantized = quantize_int8_groups(weight)
    assert quantized.group_size == 32
    dequantized = quantized.dequantize()
    assert float((dequantized - weight).abs().max()) <= float(weight.abs().max()) / 254 + 1e-6
    bias = torch.randn(out_features)
    kernel = GroupInt8Kernel(quantized, bias)
    w_groups = quantized.values.double().reshape(out_features, -1, 32)
    for rows in (1, 2, 5, 8, 9, 16, 17):
        x = _bf16(rows, in_features, seed=rows)
        q, d = q8_activations(x)
        # exact integer sums per group, scaled by both scales: the kernel's arithmetic
        sums = torch.einsum("mgk,ngk->mng", q.double(), w_groups)
        scales = d.double()[:, None, :] * quantized.scales.double()[None]
        expected = (sums * scales).sum(dim=2) + bias.to(torch.bfloat16).double()
        # float32 scaling and sum over groups, then one bf16 rounding of the output
        atol = 2**-8 * float(expected.abs().max())
        torch.testing.assert_close(kernel(x).double(), expected, rtol=2**-8, atol=atol)
        # and close to the float product: int8 activations cost about a bf16 rounding more
        exact = x.double() @ weight.double().T + bias.to(torch.bfloat16).double()
        assert float((kernel(x).double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (960, 576), (208, 1536)])
def test_int4_on_float32_computes_the_q8_dot_products(out_features, in_features):
    """`gemm_int4_f32` (float32 x, AVX2): x quantized per group of 32, exact integer products
    with the nibbles, then s d P + m d S per group in float32."""
    from worker.layers.quant import quantize_int4

    weight = quantize_int4(torch.randn(out_features, in_features))
    packed = native.pack_int4_q8(weight.values, weight.scales, weight.mins)
    bias = torch.randn(out_features)
    q_w = weight.values.double().reshape(out_features, -1, 32)
    dequantized = weight.dequantize().double()
    for rows in (1, 2, 7, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.ladle_native.gemm_int4_f32(x, packed, out_features, bias).double()
        p, d = q8_activations(x)
        products = torch.einsum("mgk,ngk->mng", p.double(), q_w)  # P per row, output, group
        d = d.double()[:, None, :]
        expected = (weight.scales.double()[None] * d * products).sum(2)
        expected += (weight.mins.double()[None] * d * p.double().sum(2)[:, None, :]).sum(2)
        expected += bias.double()
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * scale)
        # and close to the float product: the int8 activations' rounding, no more
        exact = x.double() @ dequantized.T + bias.double()
        assert float((got - exact).abs().max()) < 0.02 * float(exact.abs().max())


def _q8_definition(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """p, d and d * sum(p) per group of 32 by the definition, one IEEE operation at a time:
    d = max |x| / 127 (NaN where a value is not finite), p = clamp(round(x / d)); a product
    that is not a number becomes -127, as the kernels' conversion makes it."""
    groups = x.reshape(x.shape[0], -1, 32)
    finite = torch.isfinite(groups).all(dim=2)
    amax = torch.where(torch.isfinite(groups), groups.abs(), torch.zeros(())).amax(dim=2)
    d = torch.where(finite, amax / 127, torch.full_like(amax, float("nan")))
    inverse = torch.where(finite & (d > 0), 1 / d, torch.zeros_like(d))
    r = torch.round(groups * inverse[..., None])
    p = torch.where(r.isfinite(), r.clamp(-127, 127), torch.full_like(r, -127)).to(torch.int8)
    return p.reshape(x.shape), d, d * p.sum(dim=2, dtype=torch.int32).float()


@pytest.mark.parametrize("rows,in_features", [(1, 576), (3, 1536), (300, 576), (2048, 64)])
def test_q8_quantizing_is_the_definition_bit_for_bit(rows, in_features):
    """The float32-activation kernels' x quantizing (vectorised, threaded over groups for many
    rows) gives exactly the definition's p, d and d * sum(p), zeros, NaN and inf included, on
    one thread and on two."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator) * 10
    x *= torch.rand(rows, 1, generator=generator)
    x[0, :32] = 0.0
    if rows > 2:
        x[1, 40] = float("nan")
        x[2, 7] = float("inf")
    expected = _q8_definition(x)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            got = torch.ops.ladle_native.quantize_q8(x)
            assert torch.equal(got[0], expected[0])
            for have, want in zip(got[1:], expected[1:], strict=True):
                assert torch.equal(have.isnan(), want.isnan())
                assert torch.equal(have.nan_to_num(0.0), want.nan_to_num(0.0))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("which", ["f32", "vnni"])
def test_int8_x_int4_kernels_propagate_nan_and_zero_rows(which):
    """float32 x on AVX2 and bf16 x on VNNI: a zero row gives zeros, a NaN anywhere in a row
    NaN everywhere in it (its group's d is NaN), as in float math."""
    from worker.layers.quant import quantize_int4

    if which == "vnni" and "vnni" not in native.int4_kernels_here():
        pytest.skip("no VNNI int4 kernel on this CPU")
    weight = quantize_int4(torch.randn(32, 64))
    packed = native.pack_int4_q8(weight.values, weight.scales, weight.mins)
    x = torch.zeros(3, 64)
    x[1, 5] = float("nan")
    x[2, 40] = 1.0
    if which == "vnni":
        y = torch.ops.ladle_native.gemm_int4_q8(x.to(torch.bfloat16), packed, 32, None).float()
    else:
        y = torch.ops.ladle_native.gemm_int4_f32(x, packed, 32, None)
    assert torch.equal(y[0], torch.zeros(32))
    assert bool(y[1].isnan().all())
    assert bool(y[2].isfinite().all()) and float(y[2].abs().max()) > 0


@pytest.mark.parametrize("out_features,in_features", [(64, 32), (4096, 576)])
def test_grouped_int8_on_float32_computes_the_q8_dot_products(out_features, in_features):
    """`gemm_int8_f32` (float32 x, AVX2): the VNNI kernel's arithmetic in float32."""
    from worker.layers.quant import quantize_int8_groups

    quantized = quantize_int8_groups(torch.randn(out_features, in_features))
    quantized.values[0, :32] = -127  # the extremes: |w| p products at their largest
    quantized.values[1, :32] = 127
    packed = native.pack_int8(quantized.values, quantized.scales)
    bias = torch.randn(out_features)
    w_groups = quantized.values.double().reshape(out_features, -1, 32)
    for rows in (1, 2, 8, 9, 17):
        x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
        x[0, :32] = 4.0  # p = 127 across the first group
        got = torch.ops.ladle_native.gemm_int8_f32(x, packed, out_features, bias).double()
        p, d = q8_activations(x)
        sums = torch.einsum("mgk,ngk->mng", p.double(), w_groups)
        scales = d.double()[:, None, :] * quantized.scales.double()[None]
        expected = (sums * scales).sum(dim=2) + bias.double()
        atol = 1e-6 * float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=atol)


def test_int4_kernel_takes_float32_where_bf16_kernels_are_missing():
    from worker.layers.quant import INT4_NAMES, Int4Kernel, quantize_int4

    kernel = Int4Kernel(quantize_int4(torch.randn(64, 64)), torch.randn(64))
    bf16_name = INT4_NAMES[native.int4_kernel(64, 64)]  # whichever this CPU ran fastest
    assert kernel.name == (bf16_name if native.bf16() else "int4-native-q8")
    assert kernel.native_packed is not None
    x = torch.randn(3, 64)
    assert kernel(x).dtype == torch.float32 and kernel(x).shape == (3, 64)


@bf16_only
def test_grouped_int8_propagates_nan_and_zero_rows():
    from worker.layers.quant import GroupInt8Kernel, quantize_int8_groups

    _require_int8()
    kernel = GroupInt8Kernel(quantize_int8_groups(torch.randn(32, 64)), None)
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    x[1, 5] = float("nan")
    x[2, 40] = 1.0
    y = kernel(x).float()
    assert torch.equal(y[0], torch.zeros(32))
    assert bool(y[1].isnan().all())
    assert bool(y[2].isfinite().all()) and float(y[2].abs().max()) > 0


@bf16_only
def test_int4_without_native_uses_torch_kernel(monkeypatch):
    from worker.layers.quant import Int4Kernel, quantize_int4

    # against the native kernel on bf16 x as it is (VNNI's int8 x would add its own error)
    monkeypatch.setitem(native._state, "int4_kernel", "avx512")
    weight = quantize_int4(torch.randn(64, 64))
    native.configure(False)
    try:
        kernel = Int4Kernel(weight, None)
    finally:
        native.configure(True)
    assert kernel.name == "int4" and kernel.native_packed is None
    x = _bf16(3, 64)
    native_kernel = Int4Kernel(weight, None)
    torch.testing.assert_close(kernel(x).float(), native_kernel(x).float(), rtol=0.02, atol=0.05)


def _decode_case(
    rows: int, heads: int, kv_heads: int, head_dim: int, seed: int, dtype=torch.bfloat16
):
    block_size, num_blocks = 16, 64
    rng = random.Random(seed)
    k_cache = _bf16(kv_heads, num_blocks, block_size, head_dim, seed=seed).to(dtype)
    v_cache = _bf16(kv_heads, num_blocks, block_size, head_dim, seed=seed + 1).to(dtype)
    lens = [rng.randrange(1, 200) for _ in range(rows)]
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = torch.tensor([rng.sample(range(num_blocks), max_blocks) for _ in lens])
    padding = torch.arange(max_blocks * block_size)[None, :] >= torch.tensor(lens)[:, None]
    mask = torch.zeros(padding.shape).masked_fill_(padding, float("-inf"))[:, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(rows, dtype=torch.long),
        num_decode_tokens=rows,
        decode_block_tables=tables,
        decode_mask=mask,
        decode_context_lens=torch.tensor(lens),
    )
    q = _bf16(rows, heads, head_dim, seed=seed + 2).to(dtype)
    return q, k_cache, v_cache, meta


# bf16 attention (AVX512-BF16) and float32 attention (AVX2 or AVX-512); bf16 results within
# bf16's rounding of a float32 reference, float32 ones within float32's
DTYPES = [
    pytest.param(torch.bfloat16, marks=bf16_only, id="bf16"),
    pytest.param(torch.float32, id="float32"),
]


def _tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=2**-7, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


# the row kernel's layouts: keys plain, keys packed (what the engine's row attention uses),
# and the AMX tile kernel's (keys and values packed)
PACKED = [pytest.param("plain"), pytest.param("packed"), pytest.param("tiles")]


def _caches(k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str) -> tuple:
    """(keys, values, kernel arguments) for one layout; skips the tiles where they don't run."""
    bf16 = k_cache.dtype == torch.bfloat16
    if layout == "tiles" and not (bf16 and native.attention_tiles_usable()):
        pytest.skip("the tile kernel: bf16 on a CPU with AMX")
    if layout == "plain":
        return k_cache, v_cache, {}
    keys = native.pack_keys(k_cache)
    if layout == "packed":
        return keys, v_cache, {"packed_keys": True}
    return keys, native.pack_values(v_cache), {"packed_keys": True, "tiles": True}


@pytest.mark.parametrize("packed", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_paged_decode_matches_eager_attention(heads, kv_heads, head_dim, dtype, packed):
    q, k_cache, v_cache, meta = _decode_case(7, heads, kv_heads, head_dim, head_dim, dtype)
    scale = head_dim**-0.5
    keys, values, layout = _caches(k_cache, v_cache, packed)
    got = native.attention_rows(
        q, keys, values, meta.decode_block_tables, meta.decode_context_lens, scale, **layout
    )
    # float32 reference over exactly each row's positions
    for row, length in enumerate(meta.decode_context_lens.tolist()):
        table = meta.decode_block_tables[row]
        slots = [int(table[p // 16]) * 16 + p % 16 for p in range(length)]
        k = k_cache.view(kv_heads, -1, head_dim)[:, slots].float()
        v = v_cache.view(kv_heads, -1, head_dim)[:, slots].float()
        qf = q[row].float().view(kv_heads, heads // kv_heads, head_dim)
        expected = ((qf @ k.transpose(1, 2)) * scale).softmax(-1) @ v
        torch.testing.assert_close(
            got[row].float(), expected.reshape(heads, head_dim), **_tolerance(dtype)
        )
    # and the eager path (bf16 scores, so looser) agrees too
    eager = _decode_eager(q, k_cache, v_cache, meta, AttentionOptions(scale))
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("packed", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [1, 5, 16, 37])
def test_paged_decode_with_a_window_matches_eager_attention(window, dtype, packed):
    q, k_cache, v_cache, meta = _decode_case(7, 8, 2, 64, window, dtype)
    options = AttentionOptions(0.125, window=window)
    keys, values, layout = _caches(k_cache, v_cache, packed)
    got = native.attention_rows(
        q,
        keys,
        values,
        meta.decode_block_tables,
        meta.decode_context_lens,
        options.scale,
        meta.decode_starts(window),
        **layout,
    )
    eager = _decode_eager(q, k_cache, v_cache, meta, options)
    torch.testing.assert_close(got.float(), eager.float(), rtol=0.05, atol=0.05)
    # a row with a window equals the same row over only its last `window` keys, bit for bit
    row, length = 3, int(meta.decode_context_lens[3])
    start = max(0, length - window)
    table = meta.decode_block_tables[row : row + 1]
    alone = native.attention_rows(
        q[row : row + 1],
        keys,
        values,
        table,
        torch.tensor([length]),
        0.125,
        torch.tensor([start]),
        **layout,
    )
    assert torch.equal(alone[0], got[row])


@pytest.mark.parametrize("packed", PACKED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap,window", [(50.0, None), (5.0, None), (5.0, 9)])
def test_paged_decode_with_a_softcap_matches_float32(softcap, window, dtype, packed):
    kv_heads, heads, head_dim, scale = 2, 8, 64, 0.125
    q, k_cache, v_cache, meta = _decode_case(7, heads, kv_heads, head_dim, int(softcap), dtype)
    q = q * 4  # scores of several units, where tanh's cap bends them
    starts = meta.decode_starts(window)
    keys, values, layout = _caches(k_cache, v_cache, packed)
    attend = functools.partial(
        native.attention_rows,
        q,
        keys,
        values,
        meta.decode_block_tables,
        meta.decode_context_lens,
        scale,
        starts,
        **layout,
    )
    got = attend(softcap=softcap)
    for row, length in enumerate(meta.decode_context_lens.tolist()):
        table = meta.decode_block_tables[row]
        first = int(starts[row]) if starts is not None else 0
        slots = [int(table[p // 16]) * 16 + p % 16 for p in range(first, length)]
        k = k_cache.view(kv_heads, -1, head_dim)[:, slots].float()
        v = v_cache.view(kv_heads, -1, head_dim)[:, slots].float()
        qf = q[row].float().view(kv_heads, heads // kv_heads, head_dim)
        scores = torch.tanh((qf @ k.transpose(1, 2)) * scale / softcap) * softcap
        expected = scores.softmax(-1) @ v
        torch.testing.assert_close(
            got[row].float(), expected.reshape(heads, head_dim), **_tolerance(dtype)
        )
    assert not torch.equal(attend(), got)


def test_paged_decode_refuses_a_table_too_short():
    q, k_cache, v_cache, meta = _decode_case(2, 4, 2, 32, 3, torch.float32)
    lens = meta.decode_context_lens.clone()
    lens[0] = meta.decode_block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        torch.ops.ladle_native.paged_attention_rows(
            q, k_cache, v_cache, meta.decode_block_tables, lens, 0.1
        )


@bf16_only
def test_paged_attention_reads_q_in_place_from_a_fused_qkv():
    _, k_cache, v_cache, meta = _decode_case(5, 8, 2, 64, seed=9)
    qkv = _bf16(5, 8 + 4, 64, seed=10)
    q = qkv[:, :8]  # rows strided by the fused output's width
    args = (k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, 0.125)
    strided = torch.ops.ladle_native.paged_attention_rows(q, *args)
    assert torch.equal(strided, torch.ops.ladle_native.paged_attention_rows(q.contiguous(), *args))


def _rand(dtype: torch.dtype, *shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_equals_index_copy(dtype):
    k_cache, v_cache = _rand(dtype, 3, 10, 16, 64, seed=4), _rand(dtype, 3, 10, 16, 64, seed=5)
    # strided k/v, as they come out of a fused qkv
    qkv = _rand(dtype, 5, 9 + 6, 64, seed=6)
    k, v = qkv[:, 9:12], qkv[:, 12:]
    slots = torch.tensor([0, 17, 159, 64, 3])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    expected_k.view(3, -1, 64).index_copy_(1, slots, k.transpose(0, 1))
    expected_v.view(3, -1, 64).index_copy_(1, slots, v.transpose(0, 1))
    torch.ops.ladle_native.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.ladle_native.write_kv(k, v, k_cache, v_cache, slots + 150)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.ladle_native.write_kv(k.double(), v.double(), k_cache, v_cache, slots)
    # packed keys: the same keys, in the row kernel's layout; values as they were
    packed_k, packed_v = native.pack_keys(_rand(dtype, 3, 10, 16, 64, seed=4)), v_cache.clone()
    torch.ops.ladle_native.write_kv(k, v, packed_k, packed_v, slots, True)
    assert torch.equal(packed_k, native.pack_keys(expected_k))
    assert torch.equal(packed_v, expected_v)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        odd = _rand(dtype, 3, 10, 8, 64)
        torch.ops.ladle_native.write_kv(k, v, odd, odd.clone(), slots, True)
    # packed values (the tile kernel's layout): bf16 only
    packed_v = native.pack_values(_rand(dtype, 3, 10, 16, 64, seed=5))
    if dtype == torch.bfloat16:
        torch.ops.ladle_native.write_kv(k, v, packed_k, packed_v, slots, True, True)
        assert torch.equal(packed_v, native.pack_values(expected_v))
    else:
        with pytest.raises(RuntimeError, match="packed values need bf16"):
            torch.ops.ladle_native.write_kv(k, v, packed_k, packed_v, slots, True, True)


# the sum of squares (and exp) run in another order than eager's: bf16 results at most one
# bf16 rounding step apart, float32 ones a few float32 ulps
def _glue_tolerance(dtype: torch.dtype) -> dict:
    return dict(rtol=2**-7, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [64, 576, 100])  # 100: a masked tail
@pytest.mark.parametrize("offset", [0.0, 1.0])  # 1.0: Gemma's (1 + w)
def test_norms_match_eager(size, dtype, offset):
    norm = RMSNorm(size, 1e-5, offset).to(dtype)
    norm.weight.data = _rand(dtype, size, seed=7)
    x, residual = _rand(dtype, 5, size, seed=8), _rand(dtype, 5, size, seed=9)
    got = native.op("rms_norm", dtype)(x, norm.weight, norm.eps, offset)
    torch.testing.assert_close(got, norm(x), **_glue_tolerance(dtype))
    fused = native.op("add_rms_norm", dtype)
    normed, summed = fused(x, residual, norm.weight, norm.eps, offset)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, norm(x + residual), **_glue_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [128, 1536, 40])
def test_silu_and_gelu_mul_match_eager(size, dtype):
    x = _rand(dtype, 3, 2 * size, seed=10) * 4
    got = native.op("silu_mul", dtype)(x)
    torch.testing.assert_close(got, SiluAndMul()(x), **_glue_tolerance(dtype))
    got = native.op("gelu_tanh_mul", dtype)(x)
    torch.testing.assert_close(got, GeluTanhAndMul()(x), **_glue_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 32, 40])
def test_rotary_in_place_equals_eager(head_dim, dtype):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    rotary = RotaryEmbedding(params, head_dim, 256).to(dtype)
    rotary.build_cache()
    positions = torch.tensor([0, 5, 255, 17])
    x = _rand(dtype, 4, 6, head_dim, seed=11)
    cos, sin = rotary(positions)
    expected = apply_rotary(x[:, :5], cos, sin)
    got = x.clone()
    native.op("rotary_", dtype)(got, positions, rotary.cos_cache, rotary.sin_cache, 5)
    assert torch.equal(got[:, :5], expected)  # rounded where eager rounds: bit for bit
    assert torch.equal(got[:, 5:], x[:, 5:])  # heads past `heads` untouched


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    """head_dim 32: every native op applies, the decode attention included."""
    path = tiny_model_dir(
        "llama", tmp_path_factory.mktemp("native-model"), hidden_size=128, intermediate_size=256
    )
    add_tiny_tokenizer(path)
    return path


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_forward_matches_eager_forward(bf16_model_dir, dtype):
    loaded = load_model(str(bf16_model_dir), dtype=str(dtype).removeprefix("torch."), device="cpu")
    prompt = [random.Random(12).randrange(3, 256) for _ in range(40)]
    native_logits = greedy_logits(loaded, True, prompt, steps=6)
    eager_logits = greedy_logits(loaded, False, prompt, steps=6)
    scale = eager_logits.abs().max()
    close = 0.05 if dtype == torch.bfloat16 else 1e-4  # float32: a few ulps per op
    assert (native_logits - eager_logits).abs().max() < close * scale
    assert torch.equal(native_logits.argmax(-1), eager_logits.argmax(-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_runs_native_and_frees_every_block(bf16_model_dir, dtype):
    name = str(dtype).removeprefix("torch.")
    engine = make_test_engine(bf16_model_dir, dtype=name, linear_kernel="auto")
    assert engine.executor.kernels["forward"] == "native"
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i in range(5):
        engine.add_request(engine.prepare(f"r{i}", [3 + i] * (5 + 7 * i), params))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert len(finished) == 5
    assert all(o.num_output_tokens == 12 for o in finished.values())
    assert_all_blocks_free(engine)


def test_setting_off_runs_eager(bf16_model_dir):
    engine = make_test_engine(bf16_model_dir, dtype="bfloat16", native_kernels=False)
    try:
        assert engine.executor.kernels["forward"] == "eager"
        assert not native.loaded()
    finally:
        native.configure(True)


def test_build_failure_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    assert native.load() is False
    assert "no C++ compiler" in native.status()


def test_plain_linear_baseline_is_untouched():
    # the plain kernel is F.linear whatever the native state: the exactness tests' kernel
    w, x = torch.randn(32, 16), torch.randn(3, 16)
    assert torch.equal(build_kernel("plain", w, None)(x), F.linear(x, w))


@bf16_only
def test_int8_lm_head_quantizes_from_the_checkpoint_values():
    """A tied lm_head quantized from the checkpoint's float32 values (a GGUF's Q8_0 dequantized)
    gets the file's own integers and scales back, which its bf16 copy would not give."""
    from torch import nn

    from worker.layers.linear import Linear, head_sources, quantize_lm_head

    _require_int8()
    q = torch.randint(-127, 128, (64, 64), generator=torch.Generator().manual_seed(3))
    q[:, ::32] = 127  # every Q8_0 group holds its extreme value
    scales = torch.rand(64, 2, generator=torch.Generator().manual_seed(4)).half().float()
    file_values = (q.float().reshape(64, 2, 32) * scales[..., None]).reshape(64, 64)

    def model_with_tied_head() -> nn.Module:
        model = nn.Module()
        model.model = nn.Module()
        model.model.embed_tokens = nn.Embedding(64, 64, dtype=torch.bfloat16)
        model.lm_head = Linear(64, 64, bias=False, dtype=torch.bfloat16)
        model.lm_head.weight = model.model.embed_tokens.weight
        with torch.no_grad():
            model.lm_head.weight.copy_(file_values)
        return model

    kept: dict[str, torch.Tensor] = {}
    loaded = list(head_sources(iter([("model.embed_tokens.weight", file_values)]), kept))
    assert [name for name, _ in loaded] == ["model.embed_tokens.weight"]
    exact, from_bf16 = model_with_tied_head(), model_with_tied_head()
    assert quantize_lm_head(exact, "int8", kept)
    assert quantize_lm_head(from_bf16, "int8")
    x = _bf16(3, 64)
    expected = _int8_kernel(q, scales)(x)
    assert torch.equal(exact.lm_head(x), expected)
    assert exact.lm_head.weight is exact.model.embed_tokens.weight  # the embeddings keep it
    assert not torch.equal(from_bf16.lm_head(x), expected)


def _int8_kernel(q: torch.Tensor, scales: torch.Tensor):
    from worker.layers.quant import GroupInt8Kernel, QuantizedTensor

    return GroupInt8Kernel(QuantizedTensor("int8", q.to(torch.int8), scales), None)

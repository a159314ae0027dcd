"""Batch invariance, kernel by kernel: a row's result is bit for bit the same whatever else is
in the call (1 to 256 rows, the row at any position) and on 1 or 2 threads.

These are the kernels the deterministic mode (`LLM_DETERMINISTIC`, the default) runs; a kernel
that sums a row in an order that depends on the batch fails here at once, where a greedy
answer would only change on a near tie. Skipped where the native kernels cannot be built.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.engines import TEST_DEVICE, require_native
from worker.layers.linear_kernels import build_kernel

pytestmark = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="CPU kernels")

ROW_COUNTS = (1, 2, 4, 16, 17, 64, 256)
THREADS = (1, 2)


@pytest.fixture(scope="module", autouse=True)
def loaded_native():
    require_native(bf16=False)  # the float32 kernels build for AVX2 too; bf16 ones skip below
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_rows_invariant(fn, probe: torch.Tensor, filler: torch.Tensor) -> None:
    """fn(x)[i] depends on x[i] alone: `probe`'s rows placed first, last and amid `filler`
    rows give the same bits at every row count and thread count."""
    reference = None
    for threads in THREADS:
        torch.set_num_threads(threads)
        for rows in ROW_COUNTS:
            for at in sorted({0, rows - 1, rows // 2}):
                x = filler[:rows].clone()
                x[at] = probe
                got = fn(x)[at]
                if reference is None:
                    reference = got.clone()
                assert torch.equal(got, reference), f"{rows} rows, row {at}, {threads} threads"


@pytest.mark.parametrize("name", ["native", "amx"])
@pytest.mark.parametrize(
    "shape,bias",
    [((960, 576), False), ((208, 1534), True), ((96, 1534), True), ((64, 32), True)],
)
def test_bf16_matmul_is_batch_invariant(name, shape, bias):
    weight = _rand(*shape, seed=1) * 0.05
    kernel = build_kernel(name, weight, _rand(shape[0], seed=2) if bias else None)
    if kernel is None:
        pytest.skip(f"{name} does not apply to {shape} on this CPU")
    assert kernel.batch_invariant
    assert_rows_invariant(kernel, _rand(shape[1], seed=3), _rand(256, shape[1], seed=4))


@pytest.mark.parametrize("shape,bias", [((960, 576), False), ((48, 33), True)])
def test_float32_matmul_is_batch_invariant(shape, bias):
    weight = _rand(*shape, seed=5, dtype=torch.float32)
    kernel = build_kernel(
        "native", weight, _rand(shape[0], seed=6, dtype=torch.float32) if bias else None
    )
    assert kernel is not None and kernel.batch_invariant
    probe, filler = (_rand(256, shape[1], seed=s, dtype=torch.float32) for s in (7, 8))
    assert_rows_invariant(kernel, probe[0], filler)


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_matmul_is_batch_invariant(mode):
    from worker.layers.quant import Int4Kernel, Int8Kernel, quantize_int4, quantize_int8

    weight = torch.randn(960, 576, generator=torch.Generator().manual_seed(9))
    if mode == "int4":
        require_native(bf16=True)  # its float32 twin: test_int4_layouts_are_batch_invariant
        kernel = Int4Kernel(quantize_int4(weight), _rand(960, seed=10))
        assert kernel.name in ("int4-native", "int4-vnni", "int4-amx")  # the fastest here
    else:
        kernel = Int8Kernel(quantize_int8(weight), None)
    assert kernel.batch_invariant
    assert_rows_invariant(kernel, _rand(576, seed=11), _rand(256, 576, seed=12))


def _int4_packed(layout: str, seed: int, q8: bool = False) -> torch.Tensor:
    """A random 960 x 576 int4 weight packed with float16 scales and mins (our own int4, a
    GGUF's Q4_0/Q4_1) or float32 ones (a Q4_K's d * sc, nudged off float16 here), for
    `gemm_int4` or (`q8`) `gemm_int4_f32`."""
    from worker.layers import native
    from worker.layers.quant import quantize_int4

    weight = quantize_int4(torch.randn(960, 576, generator=torch.Generator().manual_seed(seed)))
    scales = weight.scales
    if layout == "float32":
        scales = torch.nextafter(scales, torch.full_like(scales, float("inf")))
    pack = native.pack_int4_q8 if q8 else native.pack_int4
    packed = pack(weight.values, scales, weight.mins)
    assert packed.shape[2] == (320 if layout == "float16" else 384)
    return packed


@pytest.mark.parametrize("layout", ["float16", "float32"])
def test_int4_layouts_are_batch_invariant(layout):
    """Both packed layouts of `gemm_int4` (bf16 x; `vdpbf16ps`, and AMX tiles where the CPU
    has them), `gemm_int4_q8` (bf16 x quantized per group of 32, VNNI) and `gemm_int4_f32`
    (AVX2; float32 x quantized the same way: exact integer sums)."""
    from worker.layers import native

    packed_q8 = _int4_packed(layout, seed=17, q8=True)
    bias = _rand(960, seed=18, dtype=torch.float32)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.ladle_native.gemm_int4_f32(x, packed_q8, 960, bias)

    probe, filler = (_rand(256, 576, seed=s, dtype=torch.float32) for s in (19, 20))
    assert_rows_invariant(kernel, probe[0], filler)
    if not native.bf16():
        return
    packed = _int4_packed(layout, seed=17)
    for amx in (False, True) if native.int4_amx_usable(960, 576) else (False,):

        def bf16_kernel(x: torch.Tensor, amx: bool = amx) -> torch.Tensor:
            return torch.ops.ladle_native.gemm_int4(x, packed, 960, bias if amx else None, amx)

        assert_rows_invariant(bf16_kernel, _rand(576, seed=21), _rand(256, 576, seed=22))
    if "vnni" in native.int4_kernels_here():

        def vnni_kernel(x: torch.Tensor) -> torch.Tensor:
            return torch.ops.ladle_native.gemm_int4_q8(x, packed_q8, 960, bias)

        assert_rows_invariant(vnni_kernel, _rand(576, seed=23), _rand(256, 576, seed=24))


def test_grouped_int8_matmul_is_batch_invariant():
    from worker.layers import native
    from worker.layers.quant import GroupInt8Kernel, quantize_int8_groups

    if not native.int8_f32_packable(16, 32):  # VNNI: bf16 x; else float32 x on AVX2
        pytest.skip("the native kernels did not load")
    weight = torch.randn(960, 576, generator=torch.Generator().manual_seed(13))
    kernel = GroupInt8Kernel(quantize_int8_groups(weight), _rand(960, seed=14))
    assert kernel.batch_invariant
    assert_rows_invariant(kernel, _rand(576, seed=15), _rand(256, 576, seed=16))


@pytest.mark.parametrize("layout", ["plain", "packed", "tiles"])
@pytest.mark.parametrize(
    "dtype,cache_dtype",
    [
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
        pytest.param(torch.float32, torch.float16, id="float32-float16-cache"),
    ],
)
def test_attention_row_is_batch_invariant(dtype, cache_dtype, layout):
    """A query row over its own block table gives the same bits alone, among 1 to 255 other
    rows of other lengths, or among the other rows of its own prefill (keys plain or packed;
    or on the AMX tiles, 16 rows and heads to a task; float32 queries over a float16 cache
    too), on 1 to 3 threads."""
    from worker.layers import native

    if dtype == torch.bfloat16:
        require_native(bf16=True)
    tiles, packed = layout == "tiles", layout != "plain"
    if tiles and (dtype != torch.bfloat16 or not native.attention_tiles_usable()):
        pytest.skip("the tile kernel: bf16 on a CPU with AMX")
    heads, kv_heads, head_dim, block_size, num_blocks = 9, 3, 64, 16, 48
    k_cache = _rand(kv_heads, num_blocks, block_size, head_dim, seed=13, dtype=cache_dtype)
    if packed:
        k_cache = native.pack_keys(k_cache)
    v_cache = _rand(kv_heads, num_blocks, block_size, head_dim, seed=14, dtype=cache_dtype)
    if tiles:
        v_cache = native.pack_values(v_cache)
    rng = random.Random(15)
    table = rng.sample(range(num_blocks), 20)
    probe = _rand(heads, head_dim, seed=16, dtype=dtype)
    probe_len = 301

    def attend(num_others: int, threads: int) -> torch.Tensor:
        torch.set_num_threads(threads)
        lens = [rng.randrange(1, 20 * block_size) for _ in range(num_others)]
        # others: its own prefill's rows, rows sharing only its first blocks, other tables
        tables = [_other_table(table, i, rng, num_blocks) for i in range(num_others)]
        at = num_others // 2
        lens.insert(at, probe_len)
        tables.insert(at, table)
        q = _rand(len(lens), heads, head_dim, seed=num_others, dtype=dtype)
        q[at] = probe
        out = torch.ops.ladle_native.paged_attention_rows(
            q,
            k_cache,
            v_cache,
            torch.tensor(tables),
            torch.tensor(lens),
            head_dim**-0.5,
            packed_keys=packed,
            tiles=tiles,
        )
        return out[at]

    reference = attend(0, 1)
    # 3 threads: with fewer rows than threads each (row, KV head) is dealt alone
    for threads in (*THREADS, 3):
        for num_others in (0, 1, 3, 15, 255):
            assert torch.equal(attend(num_others, threads), reference), (num_others, threads)


def _other_table(table: list[int], i: int, rng: random.Random, num_blocks: int) -> list[int]:
    if i % 3 == 0:
        return table
    shared = table[: rng.randrange(len(table))] if i % 3 == 1 else []
    rest = [b for b in rng.sample(range(num_blocks), num_blocks) if b not in shared]
    return shared + rest[: len(table) - len(shared)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_ops_are_batch_invariant(dtype):
    require_native(bf16=dtype == torch.bfloat16)
    from worker.layers import native

    weight = _rand(576, seed=17, dtype=dtype)
    filler, probe = _rand(256, 576, seed=18, dtype=dtype), _rand(576, seed=19, dtype=dtype)
    rms_norm, add_rms_norm = native.op("rms_norm", dtype), native.op("add_rms_norm", dtype)
    assert_rows_invariant(lambda x: rms_norm(x, weight, 1e-5), probe, filler)
    # a row of x and its residual side by side
    assert_rows_invariant(
        lambda x: add_rms_norm(x[:, :576], x[:, 576:], weight, 1e-5)[0],
        _rand(1152, seed=20, dtype=dtype),
        _rand(256, 1152, seed=23, dtype=dtype),
    )
    for name in ("silu_mul", "gelu_tanh_mul"):
        fn = native.op(name, dtype)
        assert_rows_invariant(
            fn, _rand(3072, seed=21, dtype=dtype), _rand(256, 3072, seed=22, dtype=dtype)
        )


def _model_dtype() -> str:
    """bf16 where its kernels build, else float32 (the AVX2 kernels)."""
    from worker.layers import native

    return "bfloat16" if native.bf16() else "float32"


def test_invariant_plan_gives_each_group_one_kernel(tmp_path):
    from tests.support.tiny_models import tiny_model_dir
    from worker.engine.autotune import choose_kernels
    from worker.models.loader import load_model

    path = tiny_model_dir("llama", tmp_path, hidden_size=128, intermediate_size=256)
    model = load_model(str(path), dtype=_model_dtype(), device="cpu").model
    plan = choose_kernels(model, "auto", 16, 2, str(tmp_path), invariant=True)
    assert plan.invariant
    for group, by_bucket in plan.kernels.items():
        assert len(set(by_bucket.values())) == 1, group
        assert set(by_bucket.values()) <= {"native", "amx"}, group


def test_one_invariant_kernel_per_group_is_used_without_timing(tmp_path, monkeypatch):
    """Without AMX each group has one invariant kernel: nothing to time, nothing to cache."""
    from tests.support.tiny_models import tiny_model_dir
    from worker.engine import autotune
    from worker.models.loader import load_model

    path = tiny_model_dir("llama", tmp_path, hidden_size=128, intermediate_size=256)
    model = load_model(str(path), dtype=_model_dtype(), device="cpu").model
    names = [n for n in autotune.kernel_names() if n != "amx"]
    monkeypatch.setattr(autotune, "kernel_names", lambda: names)

    def no_timing(*args: object, **kwargs: object) -> None:
        raise AssertionError("timed")

    monkeypatch.setattr(autotune, "measure_plan", no_timing)
    plan = autotune.choose_kernels(model, "auto", 16, 2, str(tmp_path), invariant=True)
    assert plan.invariant and plan.source == "only invariant kernel" and plan.threads == {}
    assert {n for by_bucket in plan.kernels.values() for n in by_bucket.values()} == {"native"}
    assert not (tmp_path / "kernels").exists()
    monkeypatch.setattr(autotune, "kernel_names", lambda: [*names, "amx"])
    layer = next(iter(autotune.linear_groups(model).values()))[0]
    if autotune.build_kernel("amx", layer.weight, layer.bias) is not None:  # a real choice
        with pytest.raises(AssertionError, match="timed"):
            autotune.choose_kernels(model, "auto", 16, 2, str(tmp_path), invariant=True)


def test_eager_float32_small_ops_are_batch_invariant():
    """float32 models run torch's own norms, SiLU-mul and rotary (no native ones): per row."""
    from worker.layers.activation import SiluAndMul
    from worker.layers.norm import RMSNorm
    from worker.layers.rotary import apply_rotary

    norm = RMSNorm(576, 1e-5)
    norm.weight.data = _rand(576, seed=24, dtype=torch.float32)
    filler = _rand(256, 576, seed=25, dtype=torch.float32)
    assert_rows_invariant(norm, _rand(576, seed=26, dtype=torch.float32), filler)
    wide = _rand(256, 3072, seed=27, dtype=torch.float32)
    assert_rows_invariant(SiluAndMul(), _rand(3072, seed=28, dtype=torch.float32), wide)
    cos, sin = (_rand(1, 1, 64, seed=s, dtype=torch.float32) for s in (29, 30))

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], 9, 64)
        return apply_rotary(heads, cos.expand(x.shape[0], 1, 64), sin.expand(x.shape[0], 1, 64))

    assert_rows_invariant(rotate, _rand(576, seed=31, dtype=torch.float32), filler)


def test_moe_block_is_batch_invariant():
    from worker.layers.linear import Linear
    from worker.layers.moe import MoESpec, SparseMoE

    torch.manual_seed(0)
    moe = SparseMoE(
        64, MoESpec(num_experts=16, top_k=4, intermediate_size=32, normalize_top_k=False)
    )
    dtype = getattr(torch, _model_dtype())
    moe = moe.to(dtype)
    for module in moe.modules():  # the router too: 16 outputs, the native kernel's minimum
        if isinstance(module, Linear):
            module.weight.data.normal_(0, 0.1)
            kernel = build_kernel("native", module.weight, None)
            assert kernel is not None, tuple(module.weight.shape)
            module.set_kernel(kernel)
    with torch.inference_mode():
        assert_rows_invariant(
            moe, _rand(64, seed=5, dtype=dtype), _rand(256, 64, seed=6, dtype=dtype)
        )

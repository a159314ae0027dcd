"""Every common GGUF quant type loads as gguf's reference dequantizer says; Q4_0, Q4_1 and
Q4_K map onto the int4 kernel exactly (no requantization); `auto` serves each tensor in the
precision the file holds it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.support.engines import cpu_only
from tests.support.q8 import q8_rounded
from tests.support.tiny_gguf import float32_model, preconvert, write_gguf
from tests.support.tiny_models import tiny_model_dir
from worker.layers import native, quant
from worker.layers.linear import Linear
from worker.layers.quant import INT4_NAMES, Int4Kernel
from worker.models import gguf_quant
from worker.models.gguf_convert import gguf_entries, gguf_tensors
from worker.models.gguf_quant import quantized_linear
from worker.models.loader import load_model

pytestmark = cpu_only

ROWS, COLS = 32, 512  # two K-quant super-blocks of 256 per row
# byte offsets of each block's fp16 scale fields (set to sane values in random blocks)
FP16_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_NL": [0],
    "IQ4_XS": [0],
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def random_blocks(kind: str, seed: int) -> np.ndarray:
    """Random [ROWS, bytes] data of GGML type `kind` (finite scales), or floats for F*."""
    import gguf

    rng = np.random.default_rng(seed)
    if kind in FLOAT_TYPES:
        values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    data = rng.integers(0, 256, (ROWS, COLS // block, size), dtype=np.uint8)
    for offset in FP16_FIELDS[kind]:
        scale = (rng.random((ROWS, COLS // block)) * 0.02 + 1e-3).astype(np.float16)
        data[..., offset : offset + 2] = scale.view(np.uint8).reshape(ROWS, -1, 2)
    return data.reshape(ROWS, -1)


@pytest.fixture(scope="module")
def typed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """One GGUF holding a [ROWS, COLS] linear weight of every type (layer i: type i)."""
    import gguf

    path = tmp_path_factory.mktemp("types") / "types.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    raw = {}
    for layer, kind in enumerate([*FLOAT_TYPES, *FP16_FIELDS]):
        raw[kind] = random_blocks(kind, seed=layer)
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(f"blk.{layer}.ffn_down.weight", raw[kind], raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, raw


def _reference(kind: str, data: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])


def test_every_type_loads_as_the_reference_dequantizer(typed_gguf) -> None:
    path, raw = typed_gguf
    loaded = dict(gguf_tensors(path, {"model_type": "qwen2"}))
    kinds = list(raw)
    for layer, kind in enumerate(kinds):
        ours = loaded[f"model.layers.{layer}.mlp.down_proj.weight"]
        assert ours.shape == (ROWS, COLS), kind
        np.testing.assert_array_equal(ours, _reference(kind, raw[kind]), err_msg=kind)


def test_q4_types_map_onto_int4_exactly_without_requantizing(typed_gguf, monkeypatch) -> None:
    def no_requantizing(*args: object) -> None:
        raise AssertionError("requantized")

    monkeypatch.setattr(gguf_quant, "quantize", no_requantizing)
    path, raw = typed_gguf
    for _, piece in gguf_entries(path, {"model_type": "qwen2"}):
        if piece.kind in gguf_quant.INT4_EXACT:
            weight = quantized_linear(piece, "int4")
            assert weight.mode == "int4" and weight.group_size == 32
            reference = _reference(piece.kind, raw[piece.kind])
            np.testing.assert_array_equal(weight.dequantize().numpy(), reference)


def test_other_types_requantize_to_int4_within_half_a_step(typed_gguf) -> None:
    path, raw = typed_gguf
    for _, piece in gguf_entries(path, {"model_type": "qwen2"}):
        if piece.kind not in gguf_quant.INT4_EXACT:
            weight = quantized_linear(piece, "int4")
            step = weight.scales.repeat_interleave(32, 1)
            error = weight.dequantize() - torch.from_numpy(_reference(piece.kind, raw[piece.kind]))
            assert torch.all(error.abs() <= step / 2 + 1e-5), piece.kind


def _unpacked_meta(packed: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales and mins a native int4 pack holds, as [rows, groups]."""
    blocks, groups = packed.shape[0], packed.shape[1]
    meta = packed[:, :, 256:].contiguous().view(torch.float32).reshape(blocks, groups, 2, 16)
    as_rows = meta.permute(2, 0, 3, 1).reshape(2, rows, groups)
    return as_rows[0], as_rows[1]


@pytest.mark.skipif(not (native.load() and native.bf16()), reason="no native bf16 kernels here")
def test_int4_kernel_on_q4_k_is_the_dequantized_matmul(typed_gguf) -> None:
    path, raw = typed_gguf
    piece = next(p for _, p in gguf_entries(path, {"model_type": "qwen2"}) if p.kind == "Q4_K")
    weight = quantized_linear(piece, "int4")
    native.configure(True)  # an engine built earlier in this process may have turned them off
    kernel = Int4Kernel(weight, None)
    assert kernel.name in ("int4-native", "int4-vnni", "int4-amx")  # the fastest here
    assert kernel.native_packed is not None
    scales, mins = _unpacked_meta(kernel.native_packed, ROWS)
    assert torch.equal(scales, weight.scales) and torch.equal(mins, weight.mins)  # held exactly
    reference = torch.from_numpy(_reference("Q4_K", raw["Q4_K"]))
    for rows in (1, 5, 16):
        x = torch.randn(rows, COLS, generator=torch.Generator().manual_seed(rows))
        x = x.to(torch.bfloat16)
        expected = (q8_rounded(x) if kernel.native_kernel == "vnni" else x.float()) @ reference.T
        # the kernel's bf16 output and float32 sums, at the outputs' scale
        atol = 2**-7 * float(expected.abs().max())
        torch.testing.assert_close(kernel(x).float(), expected, rtol=2**-7, atol=atol)


# Tiny Llama projections per GGUF type: 4-bit, 8-bit and float tensors in one file.
AUTO_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1"}
AUTO_TYPES |= {"ffn_gate": "F16", "ffn_up": "F16", "ffn_down": "Q8_0"}


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no int8 op")
def test_auto_serves_each_layer_as_the_file_holds_it(tmp_path: Path) -> None:
    model_dir = tiny_model_dir("llama", tmp_path)
    path = tmp_path / "mixed.gguf"
    write_gguf(float32_model(model_dir), path, AUTO_TYPES)
    preconvert(path, tmp_path)
    loaded = load_model(
        str(path), dtype="bfloat16", device="cpu", cache_dir=str(tmp_path), quantization="auto"
    )
    kernels = {
        name.split(".")[-1]: module.quantized
        for name, module in loaded.model.named_modules()
        if isinstance(module, Linear) and name.startswith("model.layers.0.")
    }
    assert kernels["qkv_proj"].name.startswith("int8")  # q, k in Q4_0 and v in Q8_0
    assert kernels["o_proj"].name.startswith("int4") and kernels["down_proj"].name == "int8"
    assert kernels["gate_up_proj"] is None  # F16 stays in the model dtype
    assert loaded.quantization == "auto (int4 x 2, int8 x 4)"
    float32 = load_model(
        str(path), dtype="float32", device="cpu", cache_dir=str(tmp_path), quantization="auto"
    )
    assert float32.quantization == "none"  # float32 asked for: no quantized kernels


def test_auto_on_a_cpu_without_bf16_serves_the_file_on_float32(tmp_path, monkeypatch) -> None:
    """`LLM_DTYPE=auto` picks float32 where the CPU lacks AVX512-BF16; "auto" then serves the
    file's 4-bit tensors in int4 on float32 activations (AVX2), as llama.cpp would run it."""
    from worker.models import loader

    model_dir = tiny_model_dir("llama", tmp_path)
    path = tmp_path / "mixed.gguf"
    write_gguf(float32_model(model_dir), path, AUTO_TYPES)
    preconvert(path, tmp_path)
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    native.configure(True)
    loaded = load_model(
        str(path), dtype="auto", device="cpu", cache_dir=str(tmp_path), quantization="auto"
    )
    assert loaded.dtype == torch.float32
    if not native.int4_f32_packable(16, 32, 32):
        assert loaded.quantization == "none"
        return
    assert loaded.quantization == "auto (int4 x 2, int8 x 4)"
    o_proj = loaded.model.model.layers[0].self_attn.o_proj.quantized
    bf16_name = INT4_NAMES[o_proj.native_kernel or "avx512"]  # whichever this CPU ran fastest
    assert o_proj.name == (bf16_name if native.bf16() else "int4-native-q8")


def test_a_q4_file_loads_in_int4_without_requantizing(tmp_path: Path, monkeypatch) -> None:
    model_dir = tiny_model_dir("llama", tmp_path)
    path = tmp_path / "q4.gguf"
    types = dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_down"), "Q4_1")
    write_gguf(float32_model(model_dir), path, types | {"ffn_gate": "Q4_0", "ffn_up": "Q4_0"})
    preconvert(path, tmp_path)

    def no_requantizing(*args: object, **kwargs: object) -> None:
        raise AssertionError("requantized")

    monkeypatch.setattr(quant, "quantize_int4", no_requantizing)
    monkeypatch.setattr(gguf_quant, "quantize", no_requantizing)
    loaded = load_model(
        str(path), dtype="bfloat16", device="cpu", cache_dir=str(tmp_path), quantization="auto"
    )
    assert loaded.quantization == "auto (int4 x 8)"

"""Weight-only int8/int4: the kernels, the GGUF block reader, and the engine end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_engine import GREEDY, random_prompts, token_ids
from tests.support.engines import cpu_only, make_engine
from tests.support.tiny_models import tiny_config
from worker.engine.engine import LLMEngine
from worker.engine.offline import LLM
from worker.layers import native, quant
from worker.layers.linear import Linear, PackedLinear, quantize_linears
from worker.layers.quant import (
    COMPUTE_DTYPE,
    QuantizationUnavailable,
    QuantizedTensor,
    build_quantized_kernel,
    check_quantization,
    quantize,
)
from worker.models import gguf_quant
from worker.models.gguf_convert import _write_weights as write_weights
from worker.models.gguf_convert import gguf_tensors
from worker.models.gguf_quant import gguf_quantized_weights, q4_to_int4
from worker.models.registry import build_model

pytestmark = cpu_only


def _reference(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None):
    """The dequantized matmul in float32, on the bf16-rounded scales the kernel holds."""
    rounded = QuantizedTensor(
        weight.mode,
        weight.values,
        weight.scales.to(COMPUTE_DTYPE).float(),
        None if weight.mins is None else weight.mins,
    )
    return F.linear(x.to(COMPUTE_DTYPE).float(), rounded.dequantize(), bias)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_dequantized_matmul(mode: str, rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 128, generator=generator) * 0.05
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 128, generator=generator)
    qweight = quantize(weight, mode)
    # The integers stand for the weight within half a step.
    step = qweight.scales if mode == "int8" else qweight.scales.repeat_interleave(32, 1).T
    error = (qweight.dequantize() - weight).abs()
    assert torch.all(error.T <= step / 2 + 1e-6 if mode == "int8" else error <= step.T / 2 + 1e-6)
    out = build_quantized_kernel(qweight, bias)(x)
    assert out.dtype == x.dtype and out.shape == (rows, 96)
    expected = _reference(x, qweight, bias)
    # Only the bf16 activations/output of the kernel separate the two.
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())


def test_int4_of_a_q4_grid_keeps_its_integers() -> None:
    """Weights on a Q4_1 grid (each group spanning 0..15) keep their integers."""
    values = torch.randint(0, 16, (16, 64), dtype=torch.uint8)
    values[:, [0, 32]], values[:, [1, 33]] = 0, 15
    scales, mins = torch.rand(16, 2) + 0.5, -torch.rand(16, 2)
    grid = QuantizedTensor("int4", values, scales, mins)
    again = quantize(grid.dequantize(), "int4")
    assert torch.equal(again.values, values)
    # Only the scales and zero points, held in bf16 by the kernel, moved (steps are >= 0.5).
    torch.testing.assert_close(again.dequantize(), grid.dequantize(), rtol=0, atol=0.1)


def test_unknown_mode_and_missing_ops_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        check_quantization("int3")
    with pytest.raises(QuantizationUnavailable, match="CPU only"):
        check_quantization("int4", "cuda")
    # A torch without one of the ops (e.g. a build older than 2.6 lacks the _for_cpu ones).
    monkeypatch.setitem(quant._OPS, "int4", ("_weight_int4pack_mm_for_cpu", "_not_in_this_torch"))
    with pytest.raises(QuantizationUnavailable, match=r"aten\._not_in_this_torch, which torch"):
        check_quantization("int4")
    check_quantization("int8")


def test_packed_linear_mixes_quantized_and_float_shards() -> None:
    """A fused layer packs a GGUF shard's own integers next to float rows quantized here."""
    layer = PackedLinear(64, [32, 32])
    torch.nn.init.normal_(layer.weight, std=0.05)
    q_shard = quantize(torch.randn(32, 64) * 0.05, "int4")
    layer.load_shard(layer.weight, 0, q_shard)
    float_rows = layer.weight[32:].detach().clone()
    layer.quantize_rows("int4")
    assert layer.weight.numel() == 0 and layer.kernel is layer.quantized
    x = torch.randn(3, 64)
    out = layer(x)
    torch.testing.assert_close(out[:, :32], _reference(x, q_shard, None), rtol=2e-2, atol=2e-2)
    expected = _reference(x, quantize(float_rows, "int4"), None)
    torch.testing.assert_close(out[:, 32:], expected, rtol=2e-2, atol=2e-2)


# ---- GGUF ------------------------------------------------------------------------------------

HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Linear weights by GGUF type: every format the quant reader maps or requantizes.
LINEAR_TYPES = {
    "attn_q": "Q4_0",
    "attn_k": "Q4_1",
    "attn_v": "Q8_0",
    "attn_output": "Q4_1",
    "ffn_gate": "Q4_0",
    "ffn_up": "F32",
    "ffn_down": "Q4_1",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[module]}.{kind}"


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of Q/K rows (what the reader undoes)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(path: Path, config) -> None:
    """A tiny Llama's random weights as a GGUF with Q4_0, Q4_1, Q8_0 and F32 tensors."""
    import gguf
    from gguf.quants import quantize as gguf_quantize

    generator = torch.Generator().manual_seed(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in build_model(config, 64).named_parameters()}
    for hf, shape in shapes.items():
        if hf == "lm_head.weight":
            continue  # tied
        name = _gguf_name(hf.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj"))
        for gguf_name, rows in _split_fused(name, shape, config):
            array = (torch.randn(rows, *shape[1:], generator=generator) * 0.05).numpy()
            if ".attn_q." in gguf_name or ".attn_k." in gguf_name:
                heads = config.num_attention_heads if ".attn_q." in gguf_name else 2
                array = _permute(array, heads)
            kind = LINEAR_TYPES.get(gguf_name.split(".")[-2], "F32")
            if gguf_name == "token_embd.weight":
                kind = "Q8_0"
            qtype = gguf.GGMLQuantizationType[kind]
            data = array if kind == "F32" else gguf_quantize(array, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _split_fused(name: str, shape: torch.Size, config) -> list[tuple[str, int]]:
    """Our fused qkv/gate_up parameters as the separate GGUF tensors they come from."""
    head = config.hidden_size // config.num_attention_heads
    if ".attn_q." in name:
        kv = config.num_key_value_heads * head
        sizes = [shape[0] - 2 * kv, kv, kv]
        return [
            (name.replace("attn_q", p), s)
            for p, s in zip(("attn_q", "attn_k", "attn_v"), sizes, strict=True)
        ]
    if ".ffn_gate." in name:
        return [(name, shape[0] // 2), (name.replace("ffn_gate", "ffn_up"), shape[0] // 2)]
    return [(name, shape[0])]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    config = tiny_config("llama")
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, config)
    return path, config.to_dict()


def test_q4_blocks_are_gguf_dequantization_exactly(tiny_gguf: tuple[Path, dict]) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    seen = set()
    for tensor in GGUFReader(str(tiny_gguf[0])).tensors:
        kind = tensor.tensor_type.name
        if kind in ("Q4_0", "Q4_1"):
            ours = q4_to_int4(np.asarray(tensor.data), kind).dequantize().numpy()
            theirs = dequantize(tensor.data, tensor.tensor_type).reshape(ours.shape)
            np.testing.assert_array_equal(ours, theirs)
            seen.add(kind)
    assert seen == {"Q4_0", "Q4_1"}


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_gguf_loads_into_quantized_layers(mode: str, tiny_gguf: tuple[Path, dict]) -> None:
    """Every layer of a model loaded from the GGUF's blocks computes what the float GGUF says."""
    path, config_dict = tiny_gguf
    config = tiny_config("llama")
    floats = {name: torch.from_numpy(np.array(a)) for name, a in gguf_tensors(path, config_dict)}
    model = build_model(config, 64)
    with torch.no_grad():
        model.load_weights(gguf_quantized_weights(path, config_dict, mode))
        assert quantize_linears(model, mode) == 4 * config.num_hidden_layers
    torch.testing.assert_close(model.model.embed_tokens.weight, floats["model.embed_tokens.weight"])
    x = torch.randn(4, 128)
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or name == "lm_head":
            continue
        parts = [name]
        if "qkv_proj" in name:
            parts = [name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
        if "gate_up" in name:
            parts = [name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")]
        weight = torch.cat([_expected_weight(f"{p}.weight", floats, mode) for p in parts])
        inputs = x[:, : module.in_features]
        expected = F.linear(inputs, weight)
        # Only the kernel's bf16 scales and activations differ from the reference.
        torch.testing.assert_close(
            module(inputs), expected, rtol=0.03, atol=0.03 * expected.abs().max().item()
        )


def test_gguf_floats_from_its_conversion_equal_the_file(
    tiny_gguf: tuple[Path, dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float tensors read from the GGUF's float32 conversion are the file's own values."""
    path, config_dict = tiny_gguf
    write_weights(path, tmp_path, config_dict, torch.float32)  # the conversion's own writer
    direct = dict(gguf_quantized_weights(path, config_dict, "int4"))
    dequantized = []
    original = gguf_quant.float_tensor
    monkeypatch.setattr(
        gguf_quant, "float_tensor", lambda name, *a: dequantized.append(name) or original(name, *a)
    )
    converted = dict(gguf_quantized_weights(path, config_dict, "int4", tmp_path))
    assert dequantized == []  # every float tensor came from the conversion
    assert direct.keys() == converted.keys()
    floats = [name for name, value in direct.items() if isinstance(value, torch.Tensor)]
    assert "model.embed_tokens.weight" in floats
    for name in floats:
        assert converted[name].dtype == torch.float32
        assert torch.equal(converted[name], direct[name]), name


def _expected_weight(hf: str, floats: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """The GGUF's own values where its type maps to `mode`, else their requantization."""
    kind = LINEAR_TYPES[_gguf_name(hf).split(".")[-2]]
    if mode == "int4" and kind in ("Q4_0", "Q4_1"):
        return floats[hf]
    return quantize(floats[hf], mode).dequantize()


# ---- engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode,native_kernels", [("int8", True), ("int4", False), ("int4", True)])
def test_quantized_engine_end_to_end(
    mode: str, native_kernels: bool, tiny_model_dirs: dict, engines: list[LLMEngine]
) -> None:
    """A mixed batch generates with quantized weights, and every kernel (torch's and Ladle's
    native int4) gives each request exactly what it gets alone: they are batch invariant."""
    prompts = random_prompts(5, [3, 17, 40, 9, 64], seed=3)
    engine = make_engine(
        tiny_model_dirs["qwen2"],
        quantization=mode,
        native_kernels=native_kernels,
        lm_head_quantization="auto",
    )
    engines.append(engine)
    assert engine.executor.loaded.quantization == mode
    # auto: the lm_head in int8 where Ladle's native kernel serves it
    head = engine.executor.loaded.model.lm_head
    int8_native = native.int8_packable(16, 32) or native.int8_f32_packable(16, 32)  # VNNI, AVX2
    assert (getattr(head.quantized, "name", None) == "int8-native") == int8_native
    llm = LLM(engine=engine)
    batched = token_ids(llm.generate(prompts, GREEDY))
    alone = [token_ids(llm.generate([p], GREEDY))[0] for p in prompts]
    assert all(len(ids) == GREEDY.max_tokens for ids in batched)
    assert batched == alone

"""Loading models: HF directories, GGUF conversion with its cache, dtypes, KV cache sizing."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shared.model_files import DEFAULT_MODEL_NAME, converted_dir, resolve_model
from tests.support.tiny_models import ArgmaxSampler, ManualBatch, make_request, tiny_model_dir
from worker.engine.kv_cache import allocate_kv_cache, kv_bytes_per_block
from worker.engine.model_runner import ModelRunner
from worker.models import loader
from worker.models.gguf_convert import hf_name, unpermute_qk
from worker.models.loader import load_model, resolve_dtype
from worker.models.registry import resolve_architecture


def test_unsupported_architecture_names_it_and_lists_supported(tmp_path):
    model_dir = tiny_model_dir("llama", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as error:
        load_model(str(model_dir), dtype="float32", device="cpu")
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in message


def test_architecture_falls_back_to_model_type():
    class Config:
        architectures = None
        model_type = "qwen3"

    assert resolve_architecture(Config()) == "Qwen3ForCausalLM"


def test_hf_dir_load(tmp_path):
    model_dir = tiny_model_dir("llama", tmp_path)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    loaded = load_model(str(model_dir), dtype="float32", device="cpu", max_model_len=100)
    assert loaded.model_dir == model_dir
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.max_model_len == 100
    assert loaded.eos_token_ids == [2, 7]
    model = loaded.model
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    qkv = model.model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == (4 * 16 + 2 * 2 * 16, 64)
    assert not any(p.is_meta for p in model.parameters())


def test_missing_weight_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = tiny_model_dir("qwen2", tmp_path)
    tensors = load_file(str(model_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj|qkv_proj"):
        load_model(str(model_dir), dtype="float32", device="cpu")


def test_sliding_window_no_longer_caps_max_model_len(tmp_path):
    # windowed layers mask exactly (tests/engine/test_families.py), so the full context serves
    model_dir = tiny_model_dir("mistral", tmp_path, sliding_window=128)
    loaded = load_model(str(model_dir), dtype="float32", device="cpu")
    assert loaded.max_model_len == 512
    assert {layer.self_attn.attn.sliding_window for layer in loaded.model.model.layers} == {128}


def test_dtype_auto(monkeypatch):
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


def test_kv_cache_sizes():
    from transformers import LlamaConfig

    smollm_like = LlamaConfig(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    )
    per_block = kv_bytes_per_block(smollm_like, 16, torch.bfloat16)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    cache = allocate_kv_cache(smollm_like, 10, 16, torch.float32, torch.device("cpu"))
    assert len(cache.k_caches) == len(cache.v_caches) == 30
    assert cache.k_caches[0].shape == (3, 10, 16, 64)  # head-major
    assert cache.num_bytes == 10 * kv_bytes_per_block(smollm_like, 16, torch.float32)


def test_gguf_names_and_unpermute():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.3.attn_k.bias") == "model.layers.3.self_attn.k_proj.bias"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    # Gemma's sandwich norms have names of their own; ffn_norm is the one before the MLP
    gemma = {
        "blk.2.ffn_norm.weight": "model.layers.2.pre_feedforward_layernorm.weight",
        "blk.2.post_attention_norm.weight": "model.layers.2.post_attention_layernorm.weight",
        "blk.2.post_ffw_norm.weight": "model.layers.2.post_feedforward_layernorm.weight",
        "blk.2.attn_q_norm.weight": "model.layers.2.self_attn.q_norm.weight",
    }
    for gguf_name, expected in gemma.items():
        assert hf_name(gguf_name, "gemma3_text") == expected
    with pytest.raises(ValueError, match="unknown GGUF tensor"):
        hf_name("blk.0.ssm_conv.weight")
    num_heads, head_dim = 3, 8
    original = np.arange(num_heads * head_dim * 5, dtype=np.float32).reshape(-1, 5)
    # llama.cpp's convert_hf_to_gguf permutation
    permuted = (
        original.reshape(num_heads, 2, head_dim // 2, 5).swapaxes(1, 2).reshape(original.shape)
    )
    np.testing.assert_array_equal(unpermute_qk(permuted, num_heads), original)


@pytest.fixture(scope="module")
def smollm_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ladle-cache"))


@pytest.fixture(scope="module")
def transformers_smollm():
    from transformers import AutoModelForCausalLM

    path = resolve_model(DEFAULT_MODEL_NAME).path
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.mark.slow
def test_gguf_conversion_matches_transformers_and_is_cached(
    smollm_cache, transformers_smollm, monkeypatch
):
    loaded = load_model(DEFAULT_MODEL_NAME, dtype="float32", device="cpu", cache_dir=smollm_cache)
    target = converted_dir(resolve_model(DEFAULT_MODEL_NAME), smollm_cache)
    assert loaded.model_dir == target
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (target / name).exists()
    assert loaded.eos_token_ids == [2] and loaded.max_model_len == 8192
    ours = _unfused_state_dict(loaded.model)
    reference = transformers_smollm.state_dict()
    assert set(ours) == {k for k in reference if k != "lm_head.weight"}
    worst = max((ours[k] - reference[k]).abs().max().item() for k in ours)
    assert worst < 1e-6

    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again instead of using the cache")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    again = load_model(DEFAULT_MODEL_NAME, dtype="float32", device="cpu", cache_dir=smollm_cache)
    assert again.model_dir == target


def _unfused_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        module = model.get_submodule(name.rsplit(".", 1)[0])
        sizes = getattr(module, "shard_sizes", None)
        if sizes is None:
            state[name] = tensor
            continue
        parts = ("q_proj", "k_proj", "v_proj") if len(sizes) == 3 else ("gate_proj", "up_proj")
        packed = "qkv_proj" if len(sizes) == 3 else "gate_up_proj"
        for part, shard in zip(parts, tensor.split(sizes), strict=True):
            state[name.replace(packed, part)] = shard
    return state


@pytest.mark.slow
def test_smollm_first_step_logits_match_transformers(smollm_cache, transformers_smollm):
    torch.manual_seed(0)
    loaded = load_model(DEFAULT_MODEL_NAME, dtype="float32", device="cpu", cache_dir=smollm_cache)
    runner = ModelRunner(loaded, num_blocks=16, block_size=16, sampler=ArgmaxSampler())
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 2, 198, 1, 4093, 198]
    batch = ManualBatch(16, [5, 2, 9])
    request = make_request("smol", prompt)
    logits = runner.compute_logits(batch.step([batch.chunk(request, len(prompt))]))[0]
    with torch.no_grad():
        expected = transformers_smollm(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(logits, expected, atol=2e-3, rtol=0)
    assert int(logits.argmax()) == int(expected.argmax())


def test_remote_code_checkpoint_is_refused_in_one_line(tmp_path):
    from worker.models.errors import ModelConfigError

    model_dir = tiny_model_dir("llama", tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        architectures=["FancyForCausalLM"],
        model_type="fancy",
        auto_map={"AutoModelForCausalLM": "modeling_fancy.FancyForCausalLM"},
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError) as error:
        load_model(str(model_dir), dtype="float32", device="cpu")
    message = str(error.value)
    assert "remote code" in message and "FancyForCausalLM" in message and "\n" not in message


def test_worker_exits_with_a_config_error_and_one_line(tmp_path, monkeypatch, caplog):
    from worker import main as worker_main
    from worker.models.errors import ModelConfigError

    async def refuse(self) -> None:
        raise ModelConfigError("unsupported model architecture GPT2LMHeadModel; supported: ...")

    monkeypatch.setattr(worker_main.WorkerProcess, "run", refuse)
    monkeypatch.setattr(worker_main, "setup_logging", lambda level: None)
    with caplog.at_level("ERROR"):
        assert worker_main.main(["--model", str(tmp_path)]) == worker_main.EXIT_CONFIG_ERROR
    lines = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(lines) == 1 and "GPT2LMHeadModel" in lines[0] and "\n" not in lines[0]

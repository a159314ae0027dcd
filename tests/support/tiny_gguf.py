"""A transformers model written as a GGUF file the way llama.cpp's converter writes it:
its tensor names and metadata keys, Q/K rows permuted for the llama arch, experts stacked,
Phi-3's LongRoPE factors as tensors. Tensors are F32 unless `types` says otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

# transformers model_type -> GGUF arch (Mixtral is a llama file with experts)
GGUF_ARCH = {
    "llama": "llama",
    "mixtral": "llama",
    "qwen2": "qwen2",
    "phi3": "phi3",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "olmoe": "olmoe",
}
_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused gate and up
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's interleaving of rotary halves in Q/K rows (what the reader undoes)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, -1).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors_of(model: Any) -> Iterator[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) for every tensor of a transformers model."""
    config = model.config
    tied = bool(getattr(config, "tie_word_embeddings", False))
    permuted = config.model_type in ("llama", "mixtral")
    for name, tensor in model.state_dict().items():
        array = tensor.detach().float().numpy()
        if name in _GLOBAL:
            if not (tied and name == "lm_head.weight"):
                yield _GLOBAL[name], array
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # [experts, 2 * ff, hidden]: gate rows first
            half = array.shape[1] // 2
            yield f"blk.{layer}.ffn_gate_exps.weight", array[:, :half]
            yield f"blk.{layer}.ffn_up_exps.weight", array[:, half:]
            continue
        if rest == "mlp.experts.down_proj":
            yield f"blk.{layer}.ffn_down_exps.weight", array
            continue
        module, kind = rest.rsplit(".", 1)
        if permuted and module in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config.num_attention_heads if "q_proj" in module else config.num_key_value_heads
            array = _permute(array, heads)
        if module == "mlp.shared_expert_gate":
            array = array.reshape(-1)  # a vector in llama.cpp's files
        yield f"blk.{layer}.{_BLOCK[module]}.{kind}", array


def _metadata(writer: Any, config: Any) -> None:
    arch = GGUF_ARCH[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name("tiny")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", 10000.0)))
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "clip_qkv", None):
        writer.add_clamp_kqv(config.clip_qkv)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "phi3":
        factor = getattr(config, "partial_rotary_factor", None) or rope.get(
            "partial_rotary_factor", 1.0
        )
        writer.add_rope_dimension_count(int(head_dim * factor))
        writer.add_sliding_window(config.sliding_window or 0)
        original = getattr(config, "original_max_position_embeddings", None)
        writer.add_rope_scaling_orig_ctx_len(original or rope["original_max_position_embeddings"])
    else:
        writer.add_rope_dimension_count(head_dim)


def write_gguf(model: Any, path: Path, types: dict[str, str] | None = None) -> None:
    """`model` (transformers, float32) as a GGUF file at `path`; `types` maps a GGUF tensor
    name's part ("attn_q", "ffn_down_exps", ...) to its GGML type (default F32)."""
    import gguf
    from gguf.quants import quantize

    config = model.config
    writer = gguf.GGUFWriter(str(path), GGUF_ARCH[config.model_type])
    _metadata(writer, config)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            factors = np.asarray(rope[f"{kind}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{kind}.weight", factors)
    for name, array in gguf_tensors_of(model):
        part = name.split(".")[-2] if name.startswith("blk.") else name
        kind = (types or {}).get(part, "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        data = array if kind == "F32" else quantize(array, qtype)
        writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def float32_model(model_dir: Path) -> Any:
    """transformers' float32 model for a tiny HF directory."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def preconvert(path: Path, cache_dir: Path) -> None:
    """Convert a tiny GGUF (which has no tokenizer) where `load_model` looks for it."""
    from shared.model_files import converted_dir, resolve_model
    from worker.models.gguf_convert import convert_gguf

    target = converted_dir(resolve_model(str(path), str(cache_dir)), str(cache_dir))
    convert_gguf(path, target, with_tokenizer=False)

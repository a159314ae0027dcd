"""What transformers' GGUF config reader leaves out, read from the file's own metadata.

transformers reads the common keys; llama.cpp's converter also writes these, which the
families need: a `llama` file with experts is Mixtral; Qwen2/3-MoE's expert sizes (and the
layers that kept a dense MLP, seen from their tensors); Qwen3-MoE's normalised top-k (always
on in llama.cpp); Phi-3's partial rotary, sliding window and LongRoPE factors (tensors).
For an arch transformers cannot read at all (OLMoE's `olmoe`), `own_config` reads the whole
config from the metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from worker.models.gguf_names import is_expert_stack


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _tensor(reader: Any, name: str) -> list[float] | None:
    for tensor in reader.tensors:
        if tensor.name == name:
            return [float(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]
    return None


def _dense_layers(reader: Any) -> list[int]:
    """Layers whose MLP is dense (no expert tensors) in a file that has experts."""
    layers = {int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk.")}
    sparse = {int(t.name.split(".")[1]) for t in reader.tensors if is_expert_stack(t.name)}
    return sorted(layers - sparse)


def _moe(config: dict, reader: Any, arch: str) -> None:
    experts = _field(reader, f"{arch}.expert_count")
    if experts is None:
        return
    if config["model_type"] in ("llama", "mistral"):
        config["model_type"] = "mixtral"
        config["num_local_experts"] = int(experts)
        config["num_experts_per_tok"] = int(_field(reader, f"{arch}.expert_used_count"))
        return
    config["num_experts"] = int(experts)
    size = _field(reader, f"{arch}.expert_feed_forward_length")
    if size is not None:
        config["moe_intermediate_size"] = int(size)
    shared = _field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config["shared_expert_intermediate_size"] = int(shared)
    config["mlp_only_layers"] = _dense_layers(reader)
    if config["model_type"] == "qwen3_moe":
        config["norm_topk_prob"] = True


def _phi3(config: dict, reader: Any) -> None:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary = _field(reader, "phi3.rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        config["partial_rotary_factor"] = int(rotary) / head_dim
    config["sliding_window"] = int(_field(reader, "phi3.attention.sliding_window") or 0) or None
    long_factor = _tensor(reader, "rope_factors_long.weight")
    if long_factor is None:
        return
    theta = (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta"))
    config["original_max_position_embeddings"] = int(
        _field(reader, "phi3.rope.scaling.original_context_length")
    )
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": theta,
        "long_factor": long_factor,
        "short_factor": _tensor(reader, "rope_factors_short.weight"),
    }
    config.pop("rope_scaling", None)


# GGUF archs whose config transformers' reader refuses: metadata key (after "<arch>.") -> ours
_OWN_CONFIG_KEYS = {
    "olmoe": {
        "context_length": "max_position_embeddings",
        "embedding_length": "hidden_size",
        "block_count": "num_hidden_layers",
        "feed_forward_length": "intermediate_size",
        "attention.head_count": "num_attention_heads",
        "attention.head_count_kv": "num_key_value_heads",
        "attention.layer_norm_rms_epsilon": "rms_norm_eps",
        "attention.clamp_kqv": "clip_qkv",
        "expert_count": "num_experts",
        "expert_used_count": "num_experts_per_tok",
    },
}
_TOKEN_IDS = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}


def own_config(reader: Any) -> dict | None:
    """transformers' config dict for a file of an arch in `_OWN_CONFIG_KEYS`, else None."""
    arch = str(_field(reader, "general.architecture"))
    if arch not in _OWN_CONFIG_KEYS:
        return None
    config: dict[str, Any] = {"model_type": arch}
    for key, name in _OWN_CONFIG_KEYS[arch].items():
        value = _field(reader, f"{arch}.{key}")
        if isinstance(value, float):  # stored as float32: 1e-6, not 9.99999997e-07
            value = float(str(np.float32(value)))
        if value is not None:
            config[name] = value
    for name, key in _TOKEN_IDS.items():
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config[name] = int(value)
    theta = _field(reader, f"{arch}.rope.freq_base")
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta or 10000.0)}
    names = {tensor.name: tensor for tensor in reader.tensors}
    config["vocab_size"] = int(names["token_embd.weight"].shape[1])  # GGUF shapes: [in, out]
    config["tie_word_embeddings"] = "output.weight" not in names
    return config


def complete_config(config: dict, reader: Any) -> dict:
    """`config` (transformers' dict for the file) with the family's keys from `reader`."""
    arch = str(_field(reader, "general.architecture"))
    _moe(config, reader, arch)
    if config["model_type"] == "phi3":
        _phi3(config, reader)
    return config

"""Mixture-of-Experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Attention as in their dense relatives (Mixtral: Mistral's, with its sliding window; Qwen2-MoE:
qkv bias; Qwen3-MoE: per-head q/k norms; OLMoE: q/k norms over all heads and optional qkv
clipping), the MLP a `SparseMoE` (Qwen2-MoE adds a sigmoid-gated shared expert; Qwen2/3-MoE
keep dense MLPs on `mlp_only_layers` and between `decoder_sparse_step` layers). Mixtral's
checkpoint names (`block_sparse_moe`, experts' w1/w3/w2) map onto HF's usual ones.
"""

from __future__ import annotations

from typing import Any

from worker.layers.moe import MoESpec
from worker.layers.rotary import rope_parameters
from worker.layers.self_attention import AttentionSpec
from worker.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from worker.models.hf_config import head_dim_of, layer_window

MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj."}
MIXTRAL_NAMES[".w2."] = ".down_proj."


def _attention(config: Any, architecture: str, index: int) -> AttentionSpec:
    head_dim = head_dim_of(config)
    qk_norm = {"Qwen3MoeForCausalLM": "head", "OlmoeForCausalLM": "full"}.get(architecture)
    is_qwen2 = architecture == "Qwen2MoeForCausalLM"
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = bool(getattr(config, "qkv_bias", True)) if is_qwen2 else attention_bias
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        qkv_bias=qkv_bias,
        o_bias=attention_bias and not is_qwen2,
        qk_norm=qk_norm,
        norm_eps=config.rms_norm_eps,
        sliding_window=layer_window(config, index),
        clip_qkv=getattr(config, "clip_qkv", None),
    )


def _is_sparse(config: Any, index: int) -> bool:
    if index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    return (index + 1) % (getattr(config, "decoder_sparse_step", None) or 1) == 0


def _mlp(config: Any, architecture: str, index: int) -> MLPSpec | MoESpec:
    if not _is_sparse(config, index):
        return MLPSpec(config.intermediate_size, config.hidden_act)
    is_mixtral = architecture == "MixtralForCausalLM"
    return MoESpec(
        num_experts=config.num_local_experts if is_mixtral else config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=getattr(config, "moe_intermediate_size", None)
        or config.intermediate_size,
        normalize_top_k=is_mixtral or bool(getattr(config, "norm_topk_prob", False)),
        act=config.hidden_act,
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )


def moe_spec(config: Any, architecture: str) -> DecoderSpec:
    layers = [
        LayerSpec(_attention(config, architecture, i), _mlp(config, architecture, i))
        for i in range(config.num_hidden_layers)
    ]
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        norm_eps=config.rms_norm_eps,
        layers=layers,
        rope={"default": rope_parameters(config)},
        head_dim=head_dim_of(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


class MoEForCausalLM(DecoderForCausalLM):
    spec_for = staticmethod(moe_spec)

    def checkpoint_name(self, name: str) -> str | None:
        for old, new in MIXTRAL_NAMES.items():
            name = name.replace(old, new)
        return super().checkpoint_name(name)

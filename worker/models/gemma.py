"""The Gemma family: Gemma 2 and Gemma 3 text.

Both: GeGLU MLPs (tanh GELU), (1 + w) RMSNorms, embeddings scaled by sqrt(hidden_size),
sandwich norms (after attention, before and after the MLP), queries scaled by
`query_pre_attn_scalar ** -0.5`, sliding-window and global layers as `layer_types` says,
tied embeddings. Gemma 2 adds soft-capping of attention scores and of the final logits;
Gemma 3 adds per-head q/k norms and a rope table per layer type (local base 10k, global 1M).
"""

from __future__ import annotations

from typing import Any

from worker.layers.rotary import rope_parameters
from worker.layers.self_attention import AttentionSpec
from worker.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from worker.models.hf_config import head_dim_of, layer_window

GEMMA3 = "Gemma3ForCausalLM"


def _layer(config: Any, index: int, is_gemma3: bool) -> LayerSpec:
    attention = AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim_of(config),
        scale=config.query_pre_attn_scalar**-0.5,
        qkv_bias=bool(getattr(config, "attention_bias", False)),
        o_bias=bool(getattr(config, "attention_bias", False)),
        qk_norm="head" if is_gemma3 else None,
        norm_eps=config.rms_norm_eps,
        norm_offset=1.0,
        sliding_window=layer_window(config, index),
        softcap=getattr(config, "attn_logit_softcapping", None),
    )
    mlp = MLPSpec(config.intermediate_size, config.hidden_activation)
    return LayerSpec(attention, mlp, rope=config.layer_types[index] if is_gemma3 else "default")


def gemma_spec(config: Any, architecture: str) -> DecoderSpec:
    is_gemma3 = architecture == GEMMA3
    if is_gemma3:
        rope = {kind: rope_parameters(config, kind) for kind in set(config.layer_types)}
    else:
        rope = {"default": rope_parameters(config)}
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        norm_eps=config.rms_norm_eps,
        layers=[_layer(config, i, is_gemma3) for i in range(config.num_hidden_layers)],
        rope=rope,
        head_dim=head_dim_of(config),
        norm_offset=1.0,
        embed_scale=config.hidden_size**0.5,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        sandwich_norms=True,
        final_softcap=getattr(config, "final_logit_softcapping", None),
    )


class GemmaForCausalLM(DecoderForCausalLM):
    spec_for = staticmethod(gemma_spec)

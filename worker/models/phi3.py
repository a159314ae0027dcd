"""Phi-3, Phi-3.5 and Phi-4-mini (Phi3ForCausalLM): Llama's decoder with q/k/v and gate/up
fused in the checkpoint too (loaded as they are), LongRoPE, a partial rotary factor (Phi-4-mini
rotates 3/4 of each head) and a sliding window over every layer where the config sets one."""

from __future__ import annotations

from typing import Any

from worker.layers.rotary import rope_parameters
from worker.layers.self_attention import AttentionSpec
from worker.models.decoder import DecoderForCausalLM, DecoderSpec, LayerSpec, MLPSpec
from worker.models.hf_config import head_dim_of, layer_window


def _layer(config: Any, index: int) -> LayerSpec:
    head_dim = head_dim_of(config)
    attention = AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads or config.num_attention_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        norm_eps=config.rms_norm_eps,
        sliding_window=layer_window(config, index),
    )
    return LayerSpec(attention, MLPSpec(config.intermediate_size, config.hidden_act))


def phi3_spec(config: Any, architecture: str) -> DecoderSpec:
    return DecoderSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        norm_eps=config.rms_norm_eps,
        layers=[_layer(config, i) for i in range(config.num_hidden_layers)],
        rope={"default": rope_parameters(config)},
        head_dim=head_dim_of(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
    )


class Phi3ForCausalLM(DecoderForCausalLM):
    spec_for = staticmethod(phi3_spec)

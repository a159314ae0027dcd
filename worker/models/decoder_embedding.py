"""Decoder embedding models (Qwen3-Embedding and other Llama-family checkpoints run for
their hidden states): the Llama family's layers, attending causally over a packed batch
without a KV cache, and no lm_head.

Checkpoints come as the bare model (`Qwen3Model`: `layers.*`) or with a causal-LM wrapper
(`model.layers.*`, `lm_head.*`); both load.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from worker.layers.dense_attention import DenseAttention
from worker.models.llama import LlamaModel, variant_for
from worker.models.weights import PACKED_WEIGHTS, load_checkpoint

# a bare decoder's architecture -> the causal-LM name our Llama family keys variants by
CAUSAL_NAMES = {
    "LlamaModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
    "Qwen3Model": "Qwen3ForCausalLM",
}


class DecoderEmbeddingModel(nn.Module):
    """forward(input_ids [T], positions [T], token_type_ids=None) -> final-norm hidden [T, H]."""

    is_causal = True
    num_labels = 0

    def __init__(self, config: Any, architecture: str, max_positions: int) -> None:
        super().__init__()
        self.config = config
        causal_name = CAUSAL_NAMES.get(architecture, architecture)
        self.model = LlamaModel(config, variant_for(causal_name, config), max_positions)
        for layer in self.model.layers:
            paged = layer.self_attn.attn
            layer.self_attn.attn = DenseAttention(
                paged.num_heads, paged.num_kv_heads, paged.head_dim, paged.scale
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions)

    def post_load(self) -> None:
        self.model.rotary_emb.build_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, _rename, PACKED_WEIGHTS)


def _rename(name: str) -> str | None:
    if name.startswith("lm_head.") or "rotary_emb.inv_freq" in name:
        return None
    return "model." + name.removeprefix("model.")

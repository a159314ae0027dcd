"""The BERT family of encoders: BERT, RoBERTa and XLM-RoBERTa, bare (embeddings) or with a
sequence-classification head (cross-encoders: ms-marco MiniLM, BGE reranker).

forward(input_ids [T], positions [T], token_type_ids [T] | None) -> hidden [T, H] over a
packed batch of whole sequences (the current `DenseBatch`). HF weight names, except that
query/key/value are fused (`attention.qkv`). RoBERTa differs in two config-driven ways: its
positions start after the padding id, and its classification head is dense-tanh-out_proj on
the first token instead of BERT's pooler then classifier.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.dense_attention import current_dense_batch, dense_attention
from worker.layers.linear import Linear, PackedLinear
from worker.models.weights import load_checkpoint

PACKED = {
    "attention.self.query": ("attention.qkv", 0),
    "attention.self.key": ("attention.qkv", 1),
    "attention.self.value": ("attention.qkv", 2),
}
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
_PREFIXES = ("bert.", "roberta.", "model.")


def is_roberta(config: Any) -> bool:
    return config.model_type in ("roberta", "xlm-roberta", "camembert")


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, hidden)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, hidden)
        self.token_type_embeddings = nn.Embedding(max(1, config.type_vocab_size), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)
        # RoBERTa numbers positions from padding_idx + 1 (HF's create_position_ids...).
        self.position_offset = int(config.pad_token_id) + 1 if is_roberta(config) else 0

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions + self.position_offset)
        )
        return self.LayerNorm(hidden)


class _DenseNorm(nn.Module):
    """dense, then LayerNorm over it plus the residual (BERT's SelfOutput and Output)."""

    def __init__(self, in_features: int, out_features: int, eps: float) -> None:
        super().__init__()
        self.dense = Linear(in_features, out_features)
        self.LayerNorm = nn.LayerNorm(out_features, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.qkv = PackedLinear(hidden, [hidden] * 3, bias=True)
        self.output = _DenseNorm(hidden, hidden, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden).view(num_tokens, 3, self.num_heads, self.head_dim).unbind(1)
        out = dense_attention(q, k, v, current_dense_batch(), self.head_dim**-0.5)
        return self.output(out.reshape(num_tokens, -1), hidden)


class _Intermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, config.intermediate_size)
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} not supported")
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(
            config.intermediate_size, config.hidden_size, config.layer_norm_eps
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class _Pooler(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden)


class _RobertaHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = Linear(hidden, hidden)
        self.out_proj = Linear(hidden, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class BertEncoderModel(nn.Module):
    """A BERT-family encoder; `num_labels` > 0 adds the sequence-classification head."""

    is_causal = False

    def __init__(self, config: Any, architecture: str, max_positions: int) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {config.position_embedding_type!r}")
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.num_labels = int(config.num_labels) if architecture.endswith("Classification") else 0
        self.roberta = is_roberta(config)
        if self.num_labels and self.roberta:
            self.classifier: nn.Module = _RobertaHead(config.hidden_size, self.num_labels)
        elif self.num_labels:
            self.pooler = _Pooler(config.hidden_size)
            self.classifier = Linear(config.hidden_size, self.num_labels)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(hidden)
        return hidden

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """Logits [B, num_labels] from each sequence's first-token state [B, H]."""
        if self.roberta:
            return self.classifier(first)
        return self.classifier(torch.tanh(self.pooler.dense(first)))

    def post_load(self) -> None:
        """Nothing derived to build (positions are learned)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_checkpoint(self, weights, self._rename, PACKED)

    def _rename(self, name: str) -> str | None:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                name = name.removeprefix(prefix)
                break
        if name.endswith("position_ids") or (name.startswith("pooler.") and not self._pools()):
            return None  # a buffer, or the pooler of a checkpoint we run without a head
        if name.startswith(("lm_head.", "cls.")):
            return None  # pre-training heads
        return name.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
            "LayerNorm.beta", "LayerNorm.bias"
        )

    def _pools(self) -> bool:
        return bool(self.num_labels) and not self.roberta

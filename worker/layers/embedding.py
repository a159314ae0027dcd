"""Token embeddings, optionally scaled (Gemma multiplies by sqrt(hidden_size))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CheckpointEmbedding(nn.Embedding):
    """nn.Embedding without its random init: the checkpoint sets every weight, and that init
    on the meta device imports torch._dynamo (0.8 s of every start)."""

    def reset_parameters(self) -> None:
        pass


class ScaledEmbedding(CheckpointEmbedding):
    """nn.Embedding times `scale`, the scale rounded to the weight's dtype first as HF does
    (the tied lm_head reads the unscaled weight)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float = 1.0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = F.embedding(input_ids, self.weight)
        if self.scale == 1.0:
            return embedded
        return embedded * torch.tensor(self.scale, dtype=self.weight.dtype)

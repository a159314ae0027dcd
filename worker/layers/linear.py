"""Linear layers whose weight packs several checkpoint tensors (fused qkv, gate_up)."""

from __future__ import annotations

import torch
from torch import nn


class PackedLinear(nn.Linear):
    """One matmul for several projections; checkpoint shards are copied into row ranges."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def load_shard(self, param: nn.Parameter, shard_index: int, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor (q, k, v, gate or up) into its rows of `param`."""
        start = sum(self.shard_sizes[:shard_index])
        size = self.shard_sizes[shard_index]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard_index} has {tensor.shape[0]} rows, expected {size}")
        param.data[start : start + size].copy_(tensor)

"""Linear layers: oneDNN-prepacked weights on CPU in bf16, and fused (packed) projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Linear):
    """nn.Linear that can keep a oneDNN-prepacked copy of its weight for CPU inference.

    On CPU in bf16 `F.linear` re-lays the weight out inside oneDNN on every call; a weight
    reordered once (`prepack()`) gives bitwise the same results and is much faster for
    small batches: one decode token of SmolLM2-135M, 35 -> 22 ms of matmuls on one core.
    The plain `weight` stays (tied embeddings, state_dict); the packed copy costs as much
    memory again. Only 2-D inputs use it.
    """

    packed_weight: torch.Tensor | None = None

    def prepack(self, batch_hint: int = 1) -> bool:
        """Reorder the weight for oneDNN; False (and nothing changes) where not supported."""
        if not _can_prepack(self.weight):
            return False
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), batch_hint)
        except RuntimeError:
            return False
        self.packed_weight = packed
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed_weight
        if packed is not None and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
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


def prepack_linears(model: nn.Module) -> int:
    """Prepack every `Linear` of `model` whose weight allows it; returns how many were."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Linear))

"""Gated MLPs: one fused [gate | up] projection, a gated activation, the down projection."""

from __future__ import annotations

import torch
from torch import nn

from worker.layers.activation import gated_activation
from worker.layers.linear import Linear, PackedLinear


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with `silu`, GeGLU with `gelu_pytorch_tanh`."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, bias: bool = False):
        super().__init__()
        size = intermediate_size
        self.gate_up_proj = PackedLinear(hidden_size, [size, size], bias=bias)
        self.down_proj = Linear(size, hidden_size, bias=bias)
        self.act = gated_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

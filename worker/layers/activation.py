"""Activations for gated MLPs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for the fused [gate | up] projection output."""

    native = False  # `ladle_native.silu_mul_bf16`, chosen at load (`use_native`)

    def use_native(self, enabled: bool) -> None:
        self.native = enabled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == torch.bfloat16 and x.dim() == 2:
            return torch.ops.ladle_native.silu_mul_bf16(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

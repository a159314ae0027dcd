"""Activations for gated MLPs: act(gate) * up over the fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import native
from worker.layers.changes import note_change


class SiluAndMul(nn.Module):
    """silu(gate) * up (SwiGLU)."""

    native = False  # `ladle_native.silu_mul_{bf16,f32}`, chosen at load (`use_native`)

    def use_native(self, enabled: bool) -> None:
        self.native = enabled
        note_change()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2:
            return native.op("silu_mul", x.dtype)(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """gelu(gate, tanh approximation) * up (GeGLU, Gemma's `gelu_pytorch_tanh`)."""

    native = False  # `ladle_native.gelu_tanh_mul_{bf16,f32}`, chosen at load (`use_native`)

    def use_native(self, enabled: bool) -> None:
        self.native = enabled
        note_change()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2:
            return native.op("gelu_tanh_mul", x.dtype)(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


GATED_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu_pytorch_tanh": GeluTanhAndMul,
    "gelu_tanh": GeluTanhAndMul,
}


def gated_activation(name: str) -> nn.Module:
    """The gated activation for a config's `hidden_act` / `hidden_activation`."""
    if name not in GATED_ACTIVATIONS:
        raise ValueError(
            f"activation {name!r} is not supported (supported: {', '.join(GATED_ACTIVATIONS)})"
        )
    return GATED_ACTIVATIONS[name]()

"""RMSNorm computed in float32, as the reference implementations do (Llama's `w * x` and
Gemma's `(1 + w) * x`); Ladle's native bf16 or float32 kernel where the model chose it at
load (`use_native`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import native
from worker.layers.changes import note_change


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in float32, cast back, then scale by the weight.

    One fused `F.rms_norm` call in float32 (bitwise equal to the op-by-op formula); in a
    narrower dtype the normalisation is fused and the cast and weight stay separate, as in
    HF, so bf16 results are bitwise unchanged too (8 small ops -> 2-3, ~64 -> ~19 us).
    `offset` 1.0 is Gemma's form: scaled by `1 + w` in float32, then cast.
    """

    def __init__(self, size: int, eps: float = 1e-6, offset: float = 0.0) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(size))
        self.native = False  # `ladle_native.rms_norm_{bf16,f32}` (bf16 or float32 weights, CPU)

    def use_native(self, enabled: bool) -> None:
        """Run on the native kernels from now on where they apply: CPU, the weight in bf16
        (the bf16 kernels loaded) or float32 (any native kernels loaded)."""
        self.native = enabled and native.serves(self.weight)
        note_change()

    def with_residual(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a residual add fused with the norm after it."""
        if self.native:
            fused = native.op("add_rms_norm", x.dtype)
            return fused(x, residual, self.weight, self.eps, self.offset)
        summed = x + residual
        return self(summed), summed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            flat = x.reshape(-1, x.shape[-1])
            out = native.op("rms_norm", x.dtype)(flat, self.weight, self.eps, self.offset)
            return out.view(x.shape)
        shape = (x.shape[-1],)
        if self.offset:
            normed = F.rms_norm(x.float(), shape, None, self.eps)
            return (normed * (self.weight.float() + self.offset)).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

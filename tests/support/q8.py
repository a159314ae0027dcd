"""x as Ladle's int8-x kernels see it (int4 on VNNI or AVX2, the int8 head): quantized per
row and group of 32 as llama.cpp quantizes activations, d = max |x| / 127."""

from __future__ import annotations

import torch


def q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p [rows, groups, 32] as float, d [rows, groups]): p = round(x / d) in -127..127."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(dim=2) / 127
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(groups * inverse[..., None]).clamp(-127, 127)
    return q, d


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K] as the products see it: p d, float32."""
    p, d = q8_activations(x)
    return (p * d[..., None]).reshape(x.shape[0], -1)

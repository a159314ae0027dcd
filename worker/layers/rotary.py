"""Rotary position embeddings: inverse frequencies per scaling type, cos/sin cache built once.

Reads transformers 5's `rope_parameters` (older `rope_scaling` + `rope_theta` as fallback;
per layer type where a config has one dict per type, as Gemma 3). Supported `rope_type`:
default, linear, dynamic, llama3, yarn, longrope. Dynamic NTK only changes the frequencies
beyond `max_position_embeddings`, which the loader never exceeds, so it equals default.
LongRoPE: HF picks the short or long factors for a whole sequence by its current length, so a
sequence's early keys would change once it grows past `original_max_position_embeddings`
(which a paged cache cannot do); here a position takes the short factors below that length and
the long ones from it on, which equals HF up to that length and HF's own cached generation of a
prompt shorter than it. A partial rotary factor rotates the first part of each head only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from worker.layers import native
from worker.layers.changes import note_change

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The config's rope dict (for `layer_type` where it has one per type) with `rope_type`,
    `rope_theta` and `partial_rotary_factor` always present."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    partial = getattr(config, "partial_rotary_factor", None) or 1.0
    params.setdefault("partial_rotary_factor", partial)
    if params["rope_type"] == "longrope":
        params.setdefault("max_position_embeddings", config.max_position_embeddings)
        original = getattr(config, "original_max_position_embeddings", None)
        params.setdefault("original_max_position_embeddings", original)
    return params


def rotary_dim_of(params: dict[str, Any], head_dim: int) -> int:
    return int(head_dim * params.get("partial_rotary_factor", 1.0))


def _longrope(
    base: float, dim: int, params: dict[str, Any], key: str
) -> tuple[torch.Tensor, float]:
    """LongRoPE's inverse frequencies with its `short_factor` or `long_factor`, and HF's
    attention factor (from `factor`, else the ratio of the context lengths)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0
        if factor > 1.0:
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(params[key], dtype=torch.float32)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext * base**shape), float(attention_factor)


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_positions: int
) -> tuple[torch.Tensor, float]:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_positions / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    params: dict[str, Any], head_dim: int, max_positions: int
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim // 2], scale applied to cos/sin) for a rope dict
    (LongRoPE: its short factors)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    dim = rotary_dim_of(params, head_dim)
    if rope_type == "longrope":
        return _longrope(base, dim, params, "short_factor")
    if rope_type == "yarn":
        return _yarn_inv_freq(base, dim, params, max_positions)
    inv_freq = _default_inv_freq(base, dim)
    if rope_type in ("default", "dynamic"):
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    raise ValueError(
        f"rope_type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RotaryEmbedding(nn.Module):
    """Holds cos/sin for every position up to `max_positions`; a step indexes it by position.

    `sin_cache` holds sin with its first half negated, so that `apply_rotary` needs a swap of
    the two halves (one `flip`) instead of HF's slice, negate and concatenate.
    """

    native = False  # rotate in place with `ladle_native.rotary_{bf16,f32}_` (`use_native`)

    def __init__(self, params: dict[str, Any], head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.params = params
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim_of(params, head_dim)
        self.max_positions = max_positions
        width = self.rotary_dim
        self.register_buffer("cos_cache", torch.empty(max_positions, width), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_positions, width), persistent=False)

    def build_cache(self) -> None:
        """Fill the cache on the buffers' device and dtype (after weights are placed)."""
        inv_freq, scale = compute_inv_freq(self.params, self.head_dim, self.max_positions)
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        if self.params["rope_type"] == "longrope":  # the long factors from the original length
            base = float(self.params["rope_theta"])
            long_freq, _ = _longrope(base, self.rotary_dim, self.params, "long_factor")
            start = self.params["original_max_position_embeddings"]
            freqs[start:] = positions[start:, None] * long_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache.copy_((emb.cos() * scale).to(self.cos_cache.dtype))
        sin = emb.sin() * scale
        sin[:, : self.rotary_dim // 2].neg_()
        self.sin_cache.copy_(sin.to(self.sin_cache.dtype))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin of shape [T, 1, head_dim] for flat positions [T] (over heads)."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def use_native(self, enabled: bool) -> None:
        """Rotate in place with `ladle_native.rotary_{bf16,f32}_` from now on (CPU)."""
        full = self.rotary_dim == self.head_dim
        self.native = enabled and native.serves(self.cos_cache) and full
        note_change()

    def rotate(self, x: torch.Tensor, num_heads: int, positions: torch.Tensor) -> torch.Tensor:
        """The first `num_heads` heads of x [T, heads, head_dim] rotated (in place on the
        native kernels, else a new tensor): what attention reads as its q and k."""
        if self.native:
            native.op("rotary_", x.dtype)(x, positions, self.cos_cache, self.sin_cache, num_heads)
            return x[:, :num_heads]
        cos, sin = self(positions)
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x[:, :num_heads], cos, sin)
        rotated = x[:, :num_heads].clone()  # partial: the rest of each head passes through
        part = x[:, :num_heads, : self.rotary_dim]
        rotated[..., : self.rotary_dim] = apply_rotary(part, cos, sin)
        return rotated


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] (HF's rotate-half convention), from RotaryEmbedding.

    x * cos + [x2, x1] * [-sin1, sin2] equals HF's x * cos + [-x2, x1] * sin bit for bit
    (negation is exact), in 4 ops instead of 7. x may be a strided view (of a fused qkv).
    """
    num_tokens, num_heads, head_dim = x.shape
    swapped = x.unflatten(-1, (2, head_dim // 2)).flip(-2).view(num_tokens, num_heads, head_dim)
    return (x * cos).add_(swapped * signed_sin)

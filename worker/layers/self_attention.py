"""A decoder's self-attention block: fused qkv, optional q/k norms and clipping, rotary,
paged attention (per-layer window and soft-cap), output projection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from worker.layers.attention import PagedAttention
from worker.layers.linear import Linear, PackedLinear
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class AttentionSpec:
    """One layer's attention, as a family's config describes it."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # the query scaling: head_dim ** -0.5, Gemma's query_pre_attn_scalar ** -0.5
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str | None = None  # "head": per head (Qwen3, Gemma 3); "full": all heads (OLMoE)
    norm_eps: float = 1e-6
    norm_offset: float = 0.0  # Gemma's (1 + w) norms
    sliding_window: int | None = None
    softcap: float | None = None
    clip_qkv: float | None = None


class SelfAttention(nn.Module):
    """forward(hidden [T, H], positions [T]) -> [T, H]; parameter names as HF's
    (`qkv_proj` fused from q/k/v_proj, `o_proj`, `q_norm`, `k_norm`)."""

    def __init__(self, spec: AttentionSpec, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.spec = spec
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = PackedLinear(spec.hidden_size, sizes, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if spec.qk_norm is not None:
            per_head = spec.qk_norm == "head"
            q_dim, k_dim = (spec.head_dim,) * 2 if per_head else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, spec.norm_eps, spec.norm_offset)
            self.k_norm = RMSNorm(k_dim, spec.norm_eps, spec.norm_offset)
        self.attn = PagedAttention(
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.scale,
            sliding_window=spec.sliding_window,
            softcap=spec.softcap,
        )
        self._rotary = [rotary]  # shared by the layers of its kind; kept out of submodules

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if self.spec.qk_norm == "head" or self.spec.clip_qkv or self.spec.qk_norm == "full":
            q, k, v = self._normed_qkv(qkv)
        else:  # q and k heads side by side: one rotary over both (in place when native)
            heads = qkv.view(num_tokens, -1, self.spec.head_dim)
            num_qk = self.spec.num_heads + self.spec.num_kv_heads
            qk = self._rotary[0].rotate(heads, num_qk, positions)
            q, k, v = qk[:, : self.spec.num_heads], qk[:, self.spec.num_heads :], heads[:, num_qk:]
            return self._attend(q, k, v)
        rotary = self._rotary[0]
        q = rotary.rotate(q, self.spec.num_heads, positions)
        k = rotary.rotate(k, self.spec.num_kv_heads, positions)
        return self._attend(q, k, v)

    def _normed_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as [T, heads, head_dim] after the family's norms and clipping."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.spec.qk_norm == "full" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.spec.clip_qkv:
            limit = self.spec.clip_qkv
            q, k, v = (t.clamp(-limit, limit) for t in (q, k, v))
        shape = (qkv.shape[0], -1, self.spec.head_dim)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        if self.spec.qk_norm == "head" and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.attn(q, k, v)
        return self.o_proj(out.view(q.shape[0], -1))

"""Paged attention: write this step's K/V into the block cache, then attend over it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.context import AttentionMetadata, PrefillChunkMeta, get_attention_metadata


class PagedAttention(nn.Module):
    """Attention over a paged cache of shape [num_kv_heads, num_blocks, block_size, head_dim].

    Head-major, so the blocks of one head gathered for a step are already in the layout
    batched matmuls and SDPA want ([heads, tokens, head_dim]): no relayout of the context.
    The runner binds `k_cache` and `v_cache` after allocating them. Inputs are flat:
    q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]; out like q.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = get_attention_metadata()
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound to the attention layer")
        # [Hkv, num_blocks * block_size, hd]: slot s of every head
        k_slots = self.k_cache.view(self.num_kv_heads, -1, self.head_dim)
        v_slots = self.v_cache.view(self.num_kv_heads, -1, self.head_dim)
        k_slots.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_slots.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        num_decode = meta.num_decode_tokens
        if num_decode == q.shape[0]:  # a decode-only step: no output buffer, no copy
            return self._decode(q, meta)
        out = q.new_empty(q.shape)
        if num_decode:
            out[:num_decode] = self._decode(q[:num_decode], meta)
        for chunk in meta.prefills:
            rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_slots, v_slots, chunk)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
        # q [B, H, Lq, D], k/v [B, Hkv, Lk, D]
        return F.scaled_dot_product_attention(
            q, k, v, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads, **kwargs
        )

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence against its cached keys, as two batched matmuls.

        The blocks in use are gathered once per head: [Hkv, D * blocks, bs, hd] is
        [Hkv * D, L, hd] (L = the longest context rounded to blocks) without a copy, so each
        KV head meets exactly its group of query heads. Scores are scaled, masked and widened
        in one op (float32 softmax). Returns [D, heads, hd].
        """
        tables = meta.decode_block_tables
        num_seqs, num_blocks = tables.shape
        length = num_blocks * self.k_cache.shape[2]
        hkv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads
        flat_tables = tables.view(-1)
        k = self.k_cache.index_select(1, flat_tables).view(hkv * num_seqs, length, -1)
        v = self.v_cache.index_select(1, flat_tables).view(hkv * num_seqs, length, -1)
        # [D, Hkv * G, hd] -> [Hkv * D, G, hd] (a small copy: one row per sequence)
        q = q.view(num_seqs, hkv, group, -1).transpose(0, 1).reshape(hkv * num_seqs, group, -1)
        scores = torch.bmm(q, k.transpose(1, 2)).view(hkv, num_seqs, group, length)
        # mask [D, 1, L] + scale * scores, in float32
        scores = torch.add(meta.decode_mask, scores, alpha=self.scale)
        probs = scores.softmax(dim=-1).to(v.dtype).view(hkv * num_seqs, group, length)
        out = torch.bmm(probs, v).view(hkv, num_seqs, group, -1)
        return out.transpose(0, 1).reshape(num_seqs, self.num_heads, -1)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        chunk: PrefillChunkMeta,
    ) -> torch.Tensor:
        if chunk.context_slots is None:
            out = self._sdpa(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
            )
        else:
            k_ctx = k_slots.index_select(1, chunk.context_slots)[None]
            v_ctx = v_slots.index_select(1, chunk.context_slots)[None]
            out = self._sdpa(q.transpose(0, 1)[None], k_ctx, v_ctx, attn_mask=chunk.mask)
        return out[0].transpose(0, 1)

"""Attention over a packed batch of whole sequences, without a KV cache (embedding models).

Rows are flat ([T, heads, head_dim], sequences back to back) so the matmuls around attention
run on real tokens only; attention itself pads the sequences to the longest one for one SDPA
call, and the padded rows are dropped again. Encoders attend both ways, decoder embedding
models causally. The batch's shape travels in a context set by the runner (as the paged
metadata does in `context.py`), so model forwards keep their plain signatures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DenseBatch:
    """Where each sequence's rows are in the flat batch, and how they attend.

    `pad_index` maps flat row i to its place in the padded [num_seqs * max_len] layout (None
    for a single sequence: no padding at all); `key_mask` ([num_seqs, 1, 1, max_len], True =
    a real key) hides padding from bidirectional attention. Causal attention needs no mask:
    padding is on the right, past every real query.
    """

    seq_lens: list[int]
    causal: bool
    max_len: int
    pad_index: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


def build_dense_batch(seq_lens: list[int], causal: bool, device: torch.device) -> DenseBatch:
    """The attention layout of sequences of `seq_lens` tokens packed in this order."""
    max_len = max(seq_lens)
    if len(seq_lens) == 1:
        return DenseBatch(seq_lens, causal, max_len)
    lens = torch.tensor(seq_lens, device=device)
    starts = torch.arange(len(seq_lens), device=device) * max_len
    offsets = torch.cumsum(lens, 0) - lens
    rows = torch.arange(int(lens.sum()), device=device)
    owner = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), lens)
    pad_index = starts[owner] + rows - offsets[owner]
    key_mask = None
    if not causal and min(seq_lens) != max_len:
        positions = torch.arange(max_len, device=device)
        key_mask = (positions[None, :] < lens[:, None]).view(len(seq_lens), 1, 1, max_len)
    return DenseBatch(seq_lens, causal, max_len, pad_index, key_mask)


_CURRENT: DenseBatch | None = None


@contextlib.contextmanager
def dense_batch(batch: DenseBatch) -> Iterator[DenseBatch]:
    """Make `batch` the layout every `DenseAttention` in this forward reads."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, batch
    try:
        yield batch
    finally:
        _CURRENT = previous


def current_dense_batch() -> DenseBatch:
    if _CURRENT is None:
        raise RuntimeError("no dense batch set for this forward")
    return _CURRENT


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: DenseBatch, scale: float
) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] of whole sequences -> [T, H, D]."""
    gqa = q.shape[1] != k.shape[1]
    if batch.pad_index is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            scale=scale,
            is_causal=batch.causal,
            enable_gqa=gqa,
        )
        return out[0].transpose(0, 1)
    out = F.scaled_dot_product_attention(
        _pad(q, batch),
        _pad(k, batch),
        _pad(v, batch),
        attn_mask=batch.key_mask,
        scale=scale,
        is_causal=batch.causal,
        enable_gqa=gqa,
    )
    flat = out.transpose(1, 2).reshape(batch.num_seqs * batch.max_len, *q.shape[1:])
    return flat.index_select(0, batch.pad_index)


def _pad(x: torch.Tensor, batch: DenseBatch) -> torch.Tensor:
    """[T, H, D] -> [num_seqs, H, max_len, D], zeros where a sequence is shorter."""
    assert batch.pad_index is not None
    padded = x.new_zeros(batch.num_seqs * batch.max_len, *x.shape[1:])
    padded.index_copy_(0, batch.pad_index, x)
    return padded.view(batch.num_seqs, batch.max_len, *x.shape[1:]).transpose(1, 2)


class DenseAttention(nn.Module):
    """Drop-in for `PagedAttention` in a model run for embeddings: the same
    `forward(q, k, v)`, over the current `DenseBatch` instead of a KV cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_attention(q, k, v, current_dense_batch(), self.scale)

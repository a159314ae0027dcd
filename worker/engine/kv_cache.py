"""The paged KV cache: preallocated per-layer K and V tensors of fixed-size blocks.

Layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] (head-major: a step's
gathered blocks are ready for batched matmuls per head). A token at position p of a
sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size` of every
head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from worker.layers.attention import PagedAttention
from worker.models.llama import head_dim_of


def _kv_shape(hf_config: Any) -> tuple[int, int, int]:
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or (
        hf_config.num_attention_heads
    )
    return hf_config.num_hidden_layers, num_kv_heads, head_dim_of(hf_config)


def kv_bytes_per_block(hf_config: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V together."""
    num_layers, num_kv_heads, head_dim = _kv_shape(hf_config)
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * element_size


@dataclass
class KVCache:
    """Per-layer K and V tensors; index i belongs to the model's i-th attention layer."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)


def allocate_kv_cache(
    hf_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> KVCache:
    num_layers, num_kv_heads, head_dim = _kv_shape(hf_config)
    storage = torch.zeros(
        2, num_layers, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype, device=device
    )
    return KVCache(
        k_caches=list(storage[0].unbind(0)),
        v_caches=list(storage[1].unbind(0)),
        num_blocks=num_blocks,
        block_size=block_size,
    )


def bind_kv_cache(model: nn.Module, cache: KVCache) -> None:
    """Give each attention layer of `model`, in order, its layer's K and V tensors."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if len(layers) != len(cache.k_caches):
        raise ValueError(f"model has {len(layers)} attention layers, cache {len(cache.k_caches)}")
    for layer, k_cache, v_cache in zip(layers, cache.k_caches, cache.v_caches, strict=True):
        layer.bind(k_cache, v_cache)

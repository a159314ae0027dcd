"""The paged KV cache: preallocated per-layer K and V tensors of fixed-size blocks.

Layout per layer: [num_kv_heads, num_blocks, block_size, head_dim] (head-major: a step's
gathered blocks are ready for batched matmuls per head). A token at position p of a
sequence lives in slot `block_ids[p // block_size] * block_size + p % block_size` of every
head.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from worker.engine.core.hybrid_blocks import local_blocks_needed
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


def per_layer_block_bytes(hf_config: Any, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes in one layer, K and V together."""
    return kv_bytes_per_block(hf_config, block_size, dtype) // _kv_shape(hf_config)[0]


@dataclass
class KVCache:
    """Per-layer K and V tensors; index i belongs to the model's i-th attention layer.
    `local_layers[i]`: layer i's tensors are the sliding-window pool's (`num_local_blocks`)."""

    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    num_blocks: int
    block_size: int
    local_layers: list[bool] = field(default_factory=list)
    num_local_blocks: int = 0

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)


def allocate_kv_cache(
    hf_config: Any,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    local_layers: list[bool] | None = None,
    num_local_blocks: int = 0,
) -> KVCache:
    """Zeroed K and V per layer; layers marked in `local_layers` get `num_local_blocks`."""
    num_layers, num_kv_heads, head_dim = _kv_shape(hf_config)
    local_layers = local_layers or [False] * num_layers
    num_local = sum(local_layers)

    def storage(layers: int, blocks: int) -> torch.Tensor:
        shape = (2, layers, num_kv_heads, blocks, block_size, head_dim)
        return zeroed(shape, dtype, device)

    pools = {False: storage(num_layers - num_local, num_blocks)}
    if num_local:
        pools[True] = storage(num_local, num_local_blocks)
    next_index = {False: 0, True: 0}
    k_caches, v_caches = [], []
    for is_local in local_layers:
        index = next_index[is_local]
        next_index[is_local] += 1
        k_caches.append(pools[is_local][0, index])
        v_caches.append(pools[is_local][1, index])
    return KVCache(k_caches, v_caches, num_blocks, block_size, local_layers, num_local_blocks)


_HUGE_PAGE = 2 << 20


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, but on the CPU from fresh anonymous pages, which the kernel zeroes as
    they are first touched (zero-filling 512 MB up front cost 0.3-1.3 s of every start), in
    2 MiB pages where the kernel has transparent huge pages: a served pool's blocks lie
    anywhere in it, and on 4 KiB pages a decode step's attention over scattered blocks took
    1.5x as long (docs/benchmarks.md)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(AttributeError, OSError):  # no THP here: 4 KiB pages
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    skip = -raw.data_ptr() % _HUGE_PAGE
    return raw[skip : skip + nbytes].view(dtype).view(shape)


def window_layers(model: nn.Module) -> list[int | None]:
    """Each attention layer's sliding window (None: global), in order."""
    return [m.sliding_window for m in model.modules() if isinstance(m, PagedAttention)]


def bind_kv_cache(model: nn.Module, cache: KVCache, activations: torch.dtype | None = None) -> None:
    """Give each attention layer of `model`, in order, its layer's K and V tensors;
    `activations`: the model's dtype where the cache's differs (`PagedAttention.bind`)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if len(layers) != len(cache.k_caches):
        raise ValueError(f"model has {len(layers)} attention layers, cache {len(cache.k_caches)}")
    local = cache.local_layers or [False] * len(layers)
    for layer, k_cache, v_cache, is_local in zip(
        layers, cache.k_caches, cache.v_caches, local, strict=True
    ):
        layer.bind(k_cache, v_cache, is_local, activations)


@dataclass(frozen=True)
class KVPools:
    """How a KV budget is split: the full pool's blocks (every layer, or only the global
    ones) and the sliding-window layers' own pool (0: none)."""

    num_blocks: int
    bytes_per_block: int  # what one full-pool block costs, over the layers it serves
    num_local_blocks: int = 0
    window: int | None = None


def split_pools(
    windows: list[int | None],
    budget: int,
    layer_block_bytes: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> KVPools:
    """One pool for all layers, or, for a model with both global and sliding-window layers
    (one window size), a local pool sized for `max_num_seqs` windows and the rest for the
    global layers, whichever gives the global layers more blocks."""
    single = KVPools(budget // (layer_block_bytes * len(windows)), layer_block_bytes * len(windows))
    sizes = {w for w in windows if w is not None}
    num_global = windows.count(None)
    if len(sizes) != 1 or num_global == 0:
        return single
    window = sizes.pop()
    num_local = local_blocks_needed(window, block_size, max_num_seqs, max_num_batched_tokens)
    local_bytes = num_local * layer_block_bytes * (len(windows) - num_global)
    num_blocks = (budget - local_bytes) // (layer_block_bytes * num_global)
    if num_blocks <= single.num_blocks:
        return single
    return KVPools(num_blocks, layer_block_bytes * num_global, num_local, window)

"""Paged attention: write this step's K/V into the block cache, then attend over it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import native
from worker.layers.changes import note_change
from worker.layers.context import AttentionMetadata, PrefillChunkMeta, get_attention_metadata
from worker.layers.handles import handle_of, resolve


class PagedAttention(nn.Module):
    """Attention over a paged cache of shape [num_kv_heads, num_blocks, block_size, head_dim].

    Head-major, so the blocks of one head gathered for a step are already in the layout
    batched matmuls and SDPA want ([heads, tokens, head_dim]): no relayout of the context.
    The runner binds `k_cache` and `v_cache` after allocating them. Inputs are flat:
    q [T, num_heads, head_dim], k and v [T, num_kv_heads, head_dim]; out like q.
    `sliding_window`: a query sees only its last that many positions (itself included, as
    HF masks them); `softcap`: scores become `softcap * tanh(scores / softcap)` (Gemma 2).
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.native_rows = False  # rows on the native kernel: chosen at `bind`
        self.activations: torch.dtype | None = None  # the queries' dtype: set at `bind`
        # keys packed for the row kernel (every row of every step on it: the runner's choice)
        self.packed_keys = False
        self.tiles = False  # on the AMX tiles (packed keys, bf16): the runner's choice too
        self.local_pool = False  # a sliding-window layer with a KV pool of its own
        # This layer's handle for the custom op, as a graph input (see `Linear`); set by bind.
        self.register_buffer("layer_id", None, persistent=False)

    def bind(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        local_pool: bool = False,
        activations: torch.dtype | None = None,
    ) -> None:
        """Attend over (and write into) these caches from now on, on the native kernel where
        it serves them (chosen here, once); `local_pool`: they are the sliding-window pool's,
        addressed by the step's `metadata.local`; `activations`: the queries' dtype (default
        the caches'; float32 over a float16 cache is the native kernel's alone)."""
        self.k_cache, self.v_cache = k_cache, v_cache
        self.local_pool = local_pool
        # the native row kernel takes a window as each row's first position, and soft-caps
        activations = activations or k_cache.dtype
        self.activations = activations
        self.native_rows = self.rows_served(k_cache.dtype, activations, k_cache.device)
        if not self.native_rows and activations != k_cache.dtype:
            raise ValueError(
                f"a {k_cache.dtype} KV cache for {activations} activations needs the native "
                "row attention (LLM_KV_CACHE_DTYPE=model serves any layer)"
            )
        self.layer_id = torch.tensor(handle_of(self))
        note_change()

    def rows_served(
        self, cache_dtype: torch.dtype, activations: torch.dtype, device: torch.device
    ) -> bool:
        """Whether the native row kernel attends every row of this layer over a cache of
        `cache_dtype`: queries of its dtype, or float32 ones over float16."""
        if activations != cache_dtype and (cache_dtype, activations) != HALF_CACHE:
            return False
        group = self.num_heads // self.num_kv_heads
        return native.serves_dtype(activations, device) and native.attention_supported(
            self.head_dim, group
        )

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.ladle.paged_attention(q, k, v, self.layer_id)
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("KV cache not bound to the attention layer")
        return paged_attention(q, k, v, self.k_cache, self.v_cache, self.options())

    def options(self) -> AttentionOptions:
        return AttentionOptions(
            self.scale,
            self.native_rows,
            self.sliding_window,
            self.softcap,
            self.local_pool,
            self.packed_keys,
            self.tiles,
        )


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer attends: query scale, native rows or eager, window, soft-cap."""

    scale: float
    native_rows: bool = False
    window: int | None = None
    softcap: float | None = None
    local_pool: bool = False
    packed_keys: bool = False  # the row kernel's layout: no other path reads such a cache
    tiles: bool = False  # the row kernel on the AMX tiles, over packed values too


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """Write this step's k/v into the caches, then attend; metadata from the step context.

    A custom op so that a compiled forward treats it as one opaque call: the per-step
    metadata (ragged chunks, block tables) stays out of the traced graph.
    """
    meta = get_attention_metadata()
    if options.local_pool:
        if meta.local is None:
            raise RuntimeError("a sliding-window pool's layer needs the step's local tables")
        meta = meta.local
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[-1]
    # [Hkv, num_blocks * block_size, hd]: slot s of every head
    k_slots = k_cache.view(num_kv_heads, -1, head_dim)
    v_slots = v_cache.view(num_kv_heads, -1, head_dim)
    if options.native_rows:
        torch.ops.ladle_native.write_kv(
            k, v, k_cache, v_cache, meta.slot_mapping, options.packed_keys, options.tiles
        )
    else:
        k_slots.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        v_slots.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    num_decode = meta.num_decode_tokens
    if num_decode == q.shape[0]:  # a decode-only step: no output buffer, no copy
        return _decode(q, k_cache, v_cache, meta, options)
    if options.packed_keys:
        raise RuntimeError("packed keys are read by the row kernel alone: every token a row")
    out = q.new_empty(q.shape)
    if num_decode:
        out[:num_decode] = _decode(q[:num_decode], k_cache, v_cache, meta, options)
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill(q[rows], k[rows], v[rows], k_slots, v_slots, chunk, options)
    return out


@torch.library.custom_op("ladle::paged_attention", mutates_args=())
def paged_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor
) -> torch.Tensor:
    """`paged_attention` for the layer behind `handle`, opaque to a compiled forward.

    The caches are reached through the handle rather than passed as mutated arguments: a
    compiled graph would otherwise functionalise the write and copy the whole cache per
    layer (measured: a one-token step 170 -> 555 ms). The op is called once per layer, in
    data order, so hiding the write from the compiler is safe.
    """
    layer = resolve(int(handle))
    return paged_attention(q, k, v, layer.k_cache, layer.v_cache, layer.options())


@paged_attention_op.register_fake
def _paged_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, **kwargs: object
) -> torch.Tensor:
    # q [B, H, Lq, D], k/v [B, Hkv, Lk, D]
    return F.scaled_dot_product_attention(
        q, k, v, scale=scale, enable_gqa=q.shape[1] != k.shape[1], **kwargs
    )


# (cache, activations): the one pair of unlike dtypes the row kernel serves
HALF_CACHE = (torch.float16, torch.float32)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    options: AttentionOptions,
) -> torch.Tensor:
    """Rows against their cached keys: the native kernel where it serves, else eager."""
    if meta.decode_context_lens is not None and options.native_rows:
        return native.attention_rows(
            q,
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            options.scale,
            meta.decode_starts(options.window),
            options.softcap,
            options.packed_keys,
            options.tiles,
        )
    if options.packed_keys:
        raise RuntimeError("packed keys are read by the row kernel alone")
    if meta.decode_mask is None:
        raise RuntimeError("rows without a mask need the native attention kernel")
    return _decode_eager(q, k_cache, v_cache, meta, options)


def _decode_eager(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    options: AttentionOptions,
) -> torch.Tensor:
    """One query per sequence against its cached keys, as two batched matmuls.

    The blocks in use are gathered once per head: [Hkv, D * blocks, bs, hd] is
    [Hkv * D, L, hd] (L = the longest context rounded to blocks) without a copy, so each
    KV head meets exactly its group of query heads. Scores are scaled, masked and widened
    in one op (float32 softmax). Returns [D, heads, hd], contiguous.
    """
    tables = meta.decode_block_tables
    num_seqs, num_blocks = tables.shape
    length = num_blocks * k_cache.shape[2]
    num_heads = q.shape[1]
    hkv = k_cache.shape[0]
    group = num_heads // hkv
    flat_tables = tables.view(-1)
    k = k_cache.index_select(1, flat_tables).view(hkv * num_seqs, length, -1)
    v = v_cache.index_select(1, flat_tables).view(hkv * num_seqs, length, -1)
    # [D, Hkv * G, hd] -> [Hkv * D, G, hd] (a small copy: one row per sequence)
    q = q.reshape(num_seqs, hkv, group, -1).transpose(0, 1).reshape(hkv * num_seqs, group, -1)
    scores = torch.bmm(q, k.transpose(1, 2)).view(hkv, num_seqs, group, length)
    mask = meta.decode_mask_for(options.window)
    if options.softcap is None:  # mask [D, 1, L] + scale * scores, in float32
        scores = torch.add(mask, scores, alpha=options.scale)
    else:
        scores = _softcapped(scores * options.scale, options.softcap) + mask
    probs = scores.softmax(dim=-1).to(v.dtype).view(hkv * num_seqs, group, length)
    out = torch.bmm(probs, v).view(hkv, num_seqs, group, -1)
    return out.transpose(0, 1).reshape(num_seqs, num_heads, -1).contiguous()


def _softcapped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    # HF's order: divide, tanh, multiply
    return torch.tanh(scores / softcap) * softcap


def _prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_slots: torch.Tensor,
    v_slots: torch.Tensor,
    chunk: PrefillChunkMeta,
    options: AttentionOptions,
) -> torch.Tensor:
    """One chunk's queries against itself (a fresh prompt) or its cached context."""
    if chunk.context_slots is None:
        keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    else:
        keys = k_slots.index_select(1, chunk.context_slots)[None]
        values = v_slots.index_select(1, chunk.context_slots)[None]
    queries = q.transpose(0, 1)[None]
    mask = chunk.mask_for(options.window, q.device)
    if options.softcap is not None:
        if mask is None:
            mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool, device=q.device).tril_()
        out = _eager_attention(queries, keys, values, mask, options)
    elif mask is None:
        out = _sdpa(queries, keys, values, options.scale, is_causal=True)
    else:
        out = _sdpa(queries, keys, values, options.scale, attn_mask=mask)
    return out[0].transpose(0, 1)


def _eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attention with soft-capped scores (SDPA has no soft-cap): q [1, H, L, D], k/v
    [1, Hkv, S, D], mask [L, S] (True = attend)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = _softcapped(torch.matmul(q, k.transpose(2, 3)) * options.scale, options.softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)

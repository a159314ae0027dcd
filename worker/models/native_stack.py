"""A decoder's layers as one native call per step, where every layer is Llama-shaped and
runs on the native kernels (`worker/layers/native/stack.cpp`), in bf16 or float32.

The C++ stack runs the ops the Python layers would run, in their order, on the same tensors:
results are bit for bit the Python loop's, without its per-layer calls. A model qualifies
when every layer has plain pre-norm attention (no q/k norms, clipping, soft-cap or window)
with native rows, native norms without offset, native full rotary shared by all layers, a
SwiGLU MLP, and every projection on a native kernel of the caches' dtype (bf16 or int4 on bf16
activations; float32 or int4 on float32 activations); any other model, and any
step that is not all rows (prefill chunks outside the invariant mode), keeps the Python loop.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from worker.layers import native
from worker.layers.activation import SiluAndMul
from worker.layers.changes import num_changes
from worker.layers.context import (
    AttentionMetadata,
    current_attention_metadata,
    get_attention_metadata,
)
from worker.layers.linear import Linear
from worker.layers.linear_kernels import NativeKernel
from worker.layers.quant import Int4Kernel

_EMPTY = torch.empty(0)
KIND_BF16, KIND_BF16_AMX, KIND_INT4, KIND_F32, KIND_INT4_F32, KIND_INT4_AMX = 0, 1, 2, 3, 4, 5
KIND_INT4_VNNI = 6
_INT4_KINDS = {"avx512": KIND_INT4, "amx": KIND_INT4_AMX, "vnni": KIND_INT4_VNNI}


class NativeStack:
    """The handle of a C++ stack over a model's layers (freed with this object)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __del__(self) -> None:
        try:
            torch.ops.ladle_native.stack_free(self.handle)
        except (AttributeError, RuntimeError):  # at interpreter exit the op may be gone
            pass

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        meta = get_attention_metadata()
        return torch.ops.ladle_native.stack_forward(
            self.handle,
            hidden,
            residual,
            positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
        )


class LayerStack:
    """A model's layers as one native call where the model and the step qualify; built on
    first use, and again when a layer's kernel, cache or native choice changed."""

    def __init__(self) -> None:
        self._stack: NativeStack | None = None
        self._built_at = -1  # `num_changes()` when built

    def for_step(self, layers: nn.ModuleList, num_tokens: int) -> NativeStack | None:
        if not native.loaded() or torch.compiler.is_compiling():
            return None
        meta = current_attention_metadata()
        if meta is None or not step_fits(meta, num_tokens):
            return None
        if self._built_at != num_changes():
            self._stack, self._built_at = build_stack(list(layers)), num_changes()
        return self._stack


def step_fits(meta: AttentionMetadata, num_tokens: int) -> bool:
    """Whether this step is all rows over their block tables (what the stack attends)."""
    return (
        meta.num_decode_tokens == num_tokens
        and meta.decode_context_lens is not None
        and meta.decode_block_tables is not None
        and meta.local is None
    )


def build_stack(layers: list[Any]) -> NativeStack | None:
    """A stack over `layers` if every one qualifies (see the module's docstring), else None."""
    if not layers or not hasattr(torch.ops.ladle_native, "stack_create"):
        return None
    first = layers[0]
    attn, rotary = first.self_attn.attn, first.self_attn._rotary[0]
    shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale)
    eps = first.input_layernorm.eps
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    for layer in layers:
        parts = _layer_parts(layer, rotary, shape, eps)
        if parts is None:
            return None
        tensors.extend(parts[0])
        ints.extend(parts[1])
    tensors += [rotary.cos_cache, rotary.sin_cache]
    layouts = {(layer.self_attn.attn.packed_keys, layer.self_attn.attn.tiles) for layer in layers}
    if len(layouts) != 1:
        return None
    handle = torch.ops.ladle_native.stack_create(
        tensors, ints, *shape[:3], eps, shape[3], *layouts.pop()
    )
    return NativeStack(int(handle))


def _linears(layer: Any) -> list[Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    found = [attn.qkv_proj, attn.o_proj]
    if hasattr(mlp, "gate_up_proj"):
        found += [mlp.gate_up_proj, mlp.down_proj]
    return found


def _plain_attention(layer: Any, rotary: Any, shape: tuple[Any, ...]) -> bool:
    """Pre-norm attention with nothing between qkv and the row kernel but a full rotary."""
    block, attn = layer.self_attn, layer.self_attn.attn
    spec = getattr(block, "spec", None)
    return (
        (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale) == shape
        and getattr(block, "q_norm", None) is None
        and not getattr(spec, "clip_qkv", None)
        and attn.softcap is None
        and attn.sliding_window is None
        and block._rotary[0] is rotary
        and rotary.native
        and attn.native_rows
        and not attn.local_pool
        and attn.k_cache is not None
        and attn.k_cache.dtype in (torch.bfloat16, torch.float32, torch.float16)
    )


def _layer_parts(
    layer: Any, rotary: Any, shape: tuple[Any, ...], eps: float
) -> tuple[list[torch.Tensor], list[int]] | None:
    """The layer's 12 tensors and 8 ints for `stack_create`, or None if it does not qualify."""
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    plain_norms = not getattr(layer, "sandwich", False) and all(
        n.native and n.offset == 0.0 and n.eps == eps for n in norms
    )
    act = getattr(layer.mlp, "act", None)
    swiglu = hasattr(layer.mlp, "gate_up_proj") and isinstance(act, SiluAndMul) and act.native
    if not (_plain_attention(layer, rotary, shape) and plain_norms and swiglu):
        return None
    tensors = [norm.weight for norm in norms]
    ints: list[int] = []
    attn = layer.self_attn.attn
    for linear in _linears(layer):
        part = _linear_part(linear, attn.activations)
        if part is None:
            return None
        tensors += [part[0], part[1]]
        ints += [part[2], linear.out_features]
    tensors += [attn.k_cache, attn.v_cache]
    return tensors, ints


def _linear_part(
    linear: Linear, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(packed weight, bias or an empty tensor, kind) of a native kernel on `dtype`
    activations: bf16 or float32, or int4 computing in that dtype."""
    kernel = linear.kernel
    f32 = dtype == torch.float32
    if isinstance(kernel, NativeKernel) and kernel.is_f32 == f32:
        bias = kernel.bias if kernel.bias is not None else _EMPTY
        kind = KIND_F32 if f32 else KIND_BF16_AMX if kernel.amx else KIND_BF16
        return kernel.packed, bias, kind
    if (
        isinstance(kernel, Int4Kernel)
        and kernel.native_packed is not None
        and kernel.compute_dtype == dtype
    ):
        bias = kernel.bias if kernel.bias is not None else _EMPTY
        kind = KIND_INT4_F32 if f32 else _INT4_KINDS[kernel.native_kernel]
        return kernel.native_packed, bias, kind
    return None

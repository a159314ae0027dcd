"""Linear kernels: interchangeable ways to compute `x @ W.T + b` for one layer.

A kernel is built once from a layer's weight and bias (it may keep its own copy: a
oneDNN-prepacked weight, a float32 copy of a bf16 weight, quantized weights) and then
called with 2-D activations. Builders are registered by name; the autotuner
(`worker/engine/autotune.py`) times every registered builder on the model's shapes and batch
buckets and gives each layer a `BucketedKernel` holding the winner per bucket. Another
weight format plugs in with `register_kernel("int8", build_int8)`.

Under `torch.compile` the kernel is opaque: layers call the custom op `ladle::linear` with
an integer handle (`worker/layers/handles.py`), so Dynamo traces around any weight layout,
mkldnn's opaque tensors included, and inductor fuses what lies between the matmuls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from worker.layers import native
from worker.layers.handles import resolve


class LinearKernel(Protocol):
    """`x [N, in] -> [N, out]` in x's dtype; `name` says which builder made it.

    `batch_invariant`: a row's result is bit for bit the same whatever the number of rows
    and threads (the deterministic mode uses only such kernels, one per layer)."""

    name: str
    batch_invariant: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


KernelBuilder = Callable[[torch.Tensor, torch.Tensor | None], LinearKernel | None]
"""(weight [out, in], bias or None) -> a kernel, or None where it does not apply."""

_BUILDERS: dict[str, KernelBuilder] = {}


def register_kernel(name: str, builder: KernelBuilder) -> None:
    """Make `name` a candidate of the autotuner and a value of `LLM_LINEAR_KERNEL`."""
    _BUILDERS[name] = builder


def kernel_names() -> list[str]:
    return list(_BUILDERS)


def build_kernel(name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    """The kernel `name` for this weight, or None where it does not apply here."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown linear kernel {name!r}; known: {', '.join(_BUILDERS)}")
    return _BUILDERS[name](weight.detach(), None if bias is None else bias.detach())


class PlainKernel:
    """`F.linear` on the layer's own weight (no extra memory)."""

    name = "plain"
    batch_invariant = False  # oneDNN/MKL choose their blocking by the row count

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PrepackedKernel:
    """oneDNN's own weight layout, reordered once (CPU, bf16 or float32).

    `F.linear` in bf16 re-lays the weight out inside oneDNN on every call; the reordered copy
    gives bitwise the same bf16 results and is much faster for small batches (one decode token
    of SmolLM2-135M: 35 -> 22 ms of matmuls on one core, `loadtest.profile_step`, 2026-11-30).
    In float32 it differs from MKL's sgemm in the last bits. Costs as much memory again.
    """

    name = "prepacked"
    batch_invariant = False

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed, self.bias = packed, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Float32Kernel:
    """A float32 copy of a narrower weight: widen x, multiply, narrow the result.

    On some CPUs a bf16 GEMV streams far below float32's bandwidth (a Xeon with AMX: 4.5-6
    vs 15-20 GB/s at one row, issue 9), so twice the bytes in float32 can still win. More
    precise than the bf16 product, so not bitwise equal to it.
    """

    name = "float32"
    batch_invariant = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight.float()
        self.bias = None if bias is None else bias.float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


def _build_prepacked(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    if (
        weight.device.type != "cpu"
        or weight.dtype not in (torch.bfloat16, torch.float32)
        or not torch.backends.mkldnn.is_available()
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    ):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    except RuntimeError:
        return None
    return PrepackedKernel(packed, bias)


def _build_float32(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    if weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    return Float32Kernel(weight, bias)


class NativeKernel:
    """Ladle's own bf16 or float32 matmul (`worker/layers/native/gemm_{bf16,f32}.cpp`).

    The weight is packed once and streamed front to back; x's rows share each load. Each row
    is summed in one fixed order whatever the row and thread counts (batch invariant). Built
    only where the native ops loaded (a C++ compiler; bf16 weights need AVX512-BF16).
    """

    name = "native"
    batch_invariant = True
    amx = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = native.pack(weight)
        self.bias = bias
        self.is_f32 = weight.dtype == torch.float32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_f32:
            return torch.ops.ladle_native.gemm_f32(x, self.packed, self.bias)
        return torch.ops.ladle_native.gemm_bf16(x, self.packed, self.bias, self.amx)


class NativeAmxKernel(NativeKernel):
    """The same packed bf16 weight through AMX tiles (Intel CPUs with AMX-BF16), every row
    count: one tile multiply covers up to 16 rows, so 16 rows cost about what one does.
    Batch invariant too, in AMX's own order (not bitwise equal to `native`)."""

    name = "amx"
    amx = True


def _build_native(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    if weight.device.type != "cpu" or not native.loaded() or not native.packable(weight):
        return None
    return NativeKernel(weight, bias)


def _build_amx(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearKernel | None:
    if weight.dtype != torch.bfloat16 or _build_native(weight, bias) is None:
        return None
    if not native.amx_usable(*weight.shape):
        return None
    return NativeAmxKernel(weight, bias)


register_kernel("plain", PlainKernel)
register_kernel("prepacked", _build_prepacked)
register_kernel("float32", _build_float32)
register_kernel("native", _build_native)
register_kernel("amx", _build_amx)


class BucketedKernel:
    """Per batch bucket, the kernel measured fastest: rows <= bucket use that bucket's.

    Never batch invariant: a row gets another kernel, so another order, as the batch grows."""

    batch_invariant = False

    def __init__(self, choices: list[tuple[int, LinearKernel]]) -> None:
        self.choices = sorted(choices, key=lambda choice: choice[0])
        self.name = "/".join(f"{rows}:{kernel.name}" for rows, kernel in self.choices)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        for max_rows, kernel in self.choices:
            if rows <= max_rows:
                return kernel(x)
        return self.choices[-1][1](x)


@torch.library.custom_op("ladle::linear", mutates_args=())
def linear_op(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    """The kernel behind `handle` (a 0-d tensor) on x [N, in], opaque to Dynamo and inductor."""
    return resolve(int(handle))(x)


@linear_op.register_fake
def _linear_fake(x: torch.Tensor, handle: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))

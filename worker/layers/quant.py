"""Weight-only quantized linears: per-channel int8 and group-wise int4 on torch's CPU kernels.

A weight is first a `QuantizedTensor` (plain integer values plus scales, rows = output
features), which checkpoint shards (q/k/v, gate/up) concatenate into a fused layer's rows and
which a GGUF's Q4_0/Q4_1/Q8_0 blocks map into (`worker/models/gguf_quant.py`). It is then
packed once into a kernel that computes `x @ W.T + b`:

* int8: `aten._weight_int8pack_mm` (int8 [N, K] and one scale per output row);
* int4: `aten._weight_int4pack_mm_for_cpu` on `_convert_weight_to_int4pack_for_cpu`'s
  layout, groups of `group_size` input features with a scale and a zero point each, or
  Ladle's native int4 kernel (groups of 32, float32 scale and min per group, w = q s + m),
  onto which GGUF's Q4_0 (s = d, m = -8 d), Q4_1 (s = d, m) and Q4_K (s = d sc, m = -dmin mb)
  map exactly (`worker/models/gguf_quant.py`).

Both kernels run on bf16 activations (`COMPUTE_DTYPE`), whatever the model dtype:
torch 2.13's CPU kernels are vectorised for bf16 only; with float32 or fp16 activations they
took 15-30x longer on SmolLM2's shapes (`loadtest.quant_kernels`, 2026-11-30, EPYC Zen 4).
torch's kernel holds scales and zeros in bf16 (relative error <= 2^-9 per group); the native
one holds them in float32, exactly.
torchao 0.18 was read, not adopted: its CPU int4/int8 weight-only tensors call these same aten
ops (`prototype/quantization/int4/int4_opaque_tensor.py`) and its PyPI wheel ships no CPU
kernels of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.layers import native

# "auto": what the checkpoint holds (a GGUF's 4-bit tensors in int4, 5-8-bit in int8; float
# checkpoints in the model dtype), resolved at load (`worker/models/loader.py`).
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
# GGUF's Q4_0/Q4_1 block size; float weights are quantized with it too (finer groups, better
# accuracy; the kernel's speed barely depends on it at these shapes).
INT4_GROUP_SIZE = 32
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the CPU int4 kernel accepts
COMPUTE_DTYPE = torch.bfloat16
_OPS = {
    "int8": ("_weight_int8pack_mm",),
    "int4": ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
}


class QuantizationUnavailable(RuntimeError):
    """This torch build lacks the kernels a quantization mode needs."""


def check_quantization(mode: str, device: torch.device | str = "cpu") -> None:
    """Raise a clear error where `mode` cannot run on `device` with this torch."""
    if mode not in QUANTIZATION_MODES:
        raise ValueError(f"unknown quantization {mode!r}; use {', '.join(QUANTIZATION_MODES)}")
    if mode in ("none", "auto"):  # auto quantizes only where the kernels serve it
        return
    if torch.device(device).type != "cpu":
        raise QuantizationUnavailable(f"quantization {mode} runs on CPU only, not {device}")
    missing = [op for op in _OPS[mode] if not hasattr(torch.ops.aten, op)]
    if missing:
        raise QuantizationUnavailable(
            f"quantization {mode} needs aten.{', aten.'.join(missing)}, which torch "
            f"{torch.__version__} lacks; use LLM_QUANTIZATION=none or a newer torch"
        )


@dataclass
class QuantizedTensor:
    """A weight [N out, K in] as integers and scales, rows in output-feature order.

    int8: `values` int8, `scales` [N] (or [N, K / group] for `GroupInt8Kernel`); w = q * scale.
    int4: `values` uint8 in 0..15, `scales` and `mins` [N, K / group]; w = q * scale + min.
    """

    mode: str
    values: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def group_size(self) -> int:
        return self.values.shape[1] // self.scales.shape[1] if self.scales.dim() == 2 else 0

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these integers stand for."""
        if self.mode == "int8" and self.scales.dim() == 1:
            return self.values.float() * self.scales[:, None]
        if self.mode == "int8":
            return self.values.float() * self.scales.repeat_interleave(self.group_size, 1)
        assert self.mins is not None
        group = self.group_size
        return self.values.float() * self.scales.repeat_interleave(
            group, 1
        ) + self.mins.repeat_interleave(group, 1)

    def rows(self, index: torch.Tensor | slice) -> QuantizedTensor:
        """The same weight restricted (or permuted) to some output rows."""
        mins = None if self.mins is None else self.mins[index]
        return QuantizedTensor(self.mode, self.values[index], self.scales[index], mins)


def _kernel_exact(values: torch.Tensor) -> torch.Tensor:
    """`values` rounded to what the kernels hold (`COMPUTE_DTYPE`), back in float32.

    Quantizing against the scales the kernel will really use keeps their rounding out of the
    weights: the integers absorb it (measured on SmolLM2's int8 top-1 agreement with float32:
    95.69% -> 95.75%, `loadtest.accuracy`, 2026-11-30, i.e. within noise there).
    """
    return values.to(COMPUTE_DTYPE).float()


def quantize_int8(weight: torch.Tensor) -> QuantizedTensor:
    """Symmetric per-output-channel int8: scale = max |w| / 127 of the row."""
    weight = weight.detach().float()
    scales = _kernel_exact(weight.abs().amax(dim=1).clamp(min=1e-12) / 127)
    values = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", values, scales)


def quantize_int4(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> QuantizedTensor:
    """Asymmetric int4 per group of `group_size` inputs: [min, max] onto 0..15 (as Q4_1)."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, not {group_size}")
    rows, cols = weight.shape
    if cols % group_size:
        raise ValueError(f"in_features {cols} is not a multiple of the group size {group_size}")
    groups = weight.detach().float().reshape(rows, cols // group_size, group_size)
    mins = groups.amin(dim=2)
    scales = ((groups.amax(dim=2) - mins) / 15).clamp(min=1e-12)
    # Rounded to float16 as Q4_1 keeps them (the integers absorb it): the native kernel then
    # streams them as float16, a sixth fewer bytes (`pack_int4`). Where a scale would be
    # subnormal or a value overflow (tiny or huge weights) they stay float32.
    half_mins, half_scales = mins.half().float(), scales.half().float()
    tiny = torch.finfo(torch.float16).tiny
    if bool(torch.isfinite(half_mins).all()) and bool((half_scales >= tiny).all()):
        mins, scales = half_mins, half_scales
    values = torch.round((groups - mins[..., None]) / scales[..., None]).clamp(0, 15)
    return QuantizedTensor("int4", values.to(torch.uint8).reshape(rows, cols), scales, mins)


def quantize(weight: torch.Tensor, mode: str) -> QuantizedTensor:
    """`weight` [N, K] in `mode` ("int8" or "int4")."""
    if mode == "int8":
        return quantize_int8(weight)
    if mode == "int4":
        return quantize_int4(weight)
    raise ValueError(f"cannot quantize to {mode!r}")


def convert(tensor: QuantizedTensor, mode: str) -> QuantizedTensor:
    """`tensor` in `mode`: as is where it already is, else requantized from its float32 values."""
    if tensor.mode == mode and (mode == "int8" or tensor.group_size in INT4_GROUP_SIZES):
        return tensor
    return quantize(tensor.dequantize(), mode)


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Shards of one fused layer (same mode and group size), stacked in order."""
    first = parts[0]
    if any(p.mode != first.mode or p.group_size != first.group_size for p in parts):
        raise ValueError("shards of a fused layer must share quantization mode and group size")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts])  # type: ignore[misc]
    return QuantizedTensor(
        first.mode,
        torch.cat([p.values for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
    )


class WeightOnlyKernel:
    """`x @ W.T + b` for a quantized W: x cast to `compute_dtype`, the result cast back."""

    name = ""
    batch_invariant = False

    def __init__(
        self,
        weight: QuantizedTensor,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype = COMPUTE_DTYPE,
    ) -> None:
        self.compute_dtype = compute_dtype
        self.out_features = weight.values.shape[0]
        self.pack(weight)  # may choose the compute dtype its kernel takes
        self.bias = None if bias is None else bias.detach().to(self.compute_dtype)

    def pack(self, weight: QuantizedTensor) -> None:
        raise NotImplementedError

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x.to(self.compute_dtype).contiguous())
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype)


class Int8Kernel(WeightOnlyKernel):
    """Per-channel int8 W (`aten._weight_int8pack_mm`)."""

    name = "int8"
    batch_invariant = True  # checked per row count and thread count in tests/engine

    def pack(self, weight: QuantizedTensor) -> None:
        self.values = weight.values.contiguous()
        self.scales = weight.scales.to(self.compute_dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.values, self.scales)


# The bf16-activation native int4 kernels' names, as `GET /v1/workers` shows them.
INT4_NAMES = {"avx512": "int4-native", "vnni": "int4-vnni", "amx": "int4-amx"}


class Int4Kernel(WeightOnlyKernel):
    """Group-wise int4 W: Ladle's native kernel where it loaded (groups of 32, float32 scales
    and mins, exactly the `QuantizedTensor`'s), else `aten._weight_int4pack_mm_for_cpu` (bf16
    scales and zeros). Both compute with bf16 activations; on a CPU without AVX512-BF16 the
    native kernel takes float32 ones instead (`gemm_int4_f32`, AVX2: x quantized to int8 per
    group of 32, as llama.cpp does there).

    The native ones stream nibbles straight into bf16 or integer dot products, one row or
    many, in one order per row (batch invariant, `worker/layers/native/gemm_int4.cpp`). For
    bf16 activations `native.load` times the kernels this CPU has once per machine and keeps
    the fastest for every row count: `vdpbf16ps` on bf16 x ("avx512"), x quantized to int8
    per group of 32 on `vpdpbusd` ("vnni", as llama.cpp's 4-bit dots), or the AMX tiles."""

    name = "int4"
    batch_invariant = True
    native_packed: torch.Tensor | None = None
    native_kernel = ""  # for bf16 x: "avx512", "vnni" or "amx" (`native.int4_kernel`)

    @property
    def amx(self) -> bool:
        return self.native_kernel == "amx"

    def pack(self, weight: QuantizedTensor) -> None:
        assert weight.mins is not None
        self.group_size = weight.group_size
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 kernel needs a group size in {INT4_GROUP_SIZES}")
        n, k = weight.shape
        bf16 = self.compute_dtype == torch.bfloat16 and native.int4_packable(n, k, self.group_size)
        if bf16 or native.int4_f32_packable(n, k, self.group_size):  # else float32 x on AVX2
            self.native_kernel = native.int4_kernel(n, k) if bf16 else ""
            q8 = self.native_kernel in ("", "vnni")
            pack = native.pack_int4_q8 if q8 else native.pack_int4
            self.native_packed = pack(weight.values, weight.scales, weight.mins)
            if not bf16:
                self.compute_dtype, self.name = torch.float32, "int4-native-q8"
            else:
                self.name = INT4_NAMES[self.native_kernel]
            return
        zeros = weight.mins + 8 * weight.scales  # torch's zero: the value at q = 8
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.values.to(torch.int32).contiguous(), 1
        )
        # [K / group, N, 2]: scale and zero of every group
        pairs = torch.stack([weight.scales, zeros], dim=-1).transpose(0, 1)
        self.scales_and_zeros = pairs.to(self.compute_dtype).contiguous()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_packed is not None and self.compute_dtype == torch.float32:
            return torch.ops.ladle_native.gemm_int4_f32(
                x, self.native_packed, self.out_features, None
            )
        if self.native_packed is not None and self.native_kernel == "vnni":
            return torch.ops.ladle_native.gemm_int4_q8(
                x, self.native_packed, self.out_features, None
            )
        if self.native_packed is not None:
            return torch.ops.ladle_native.gemm_int4(
                x, self.native_packed, self.out_features, None, self.amx
            )
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )


class GroupInt8Kernel(WeightOnlyKernel):
    """int8 W with one float32 scale per row and group of 32 inputs (GGUF's Q8_0 shape) on
    Ladle's native kernel, for a quantized model's lm_head (`quantize_lm_head`): half the
    bf16 weight's bytes, which one decode step reads whole, with 8-bit values as llama.cpp
    keeps its output (Q6_K or Q8_0), and x quantized to int8 per group of 32 as llama.cpp
    does for its Q8_0 dots. Batch invariant (`worker/layers/native/gemm_int8.cpp`). Without
    AVX512-VNNI it runs on AVX2 with float32 activations (`gemm_int8_f32`, the same rounding)."""

    name = "int8-native"
    batch_invariant = True

    def pack(self, weight: QuantizedTensor) -> None:
        if weight.group_size != 32:
            raise ValueError("the native int8 kernel takes groups of 32 inputs")
        self.native_packed = native.pack_int8(weight.values, weight.scales)
        if not native.int8_packable(*weight.shape):  # no VNNI: float32 x on AVX2
            self.compute_dtype = torch.float32

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.compute_dtype == torch.float32:
            return torch.ops.ladle_native.gemm_int8_f32(
                x, self.native_packed, self.out_features, None
            )
        return torch.ops.ladle_native.gemm_int8(x, self.native_packed, self.out_features, None)


def quantize_int8_groups(
    weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE
) -> QuantizedTensor:
    """Symmetric int8 per group of `group_size` inputs (as Q8_0): scale = max |w| / 127 of the
    group, held in float32. `scales` is [N, K / group]: only `GroupInt8Kernel` takes it."""
    rows, cols = weight.shape
    groups = weight.detach().float().reshape(rows, cols // group_size, group_size)
    scales = (groups.abs().amax(dim=2) / 127).clamp(min=1e-12)
    values = torch.round(groups / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", values.reshape(rows, cols), scales)


QuantizedKernel = Int8Kernel | Int4Kernel | GroupInt8Kernel


def build_quantized_kernel(weight: QuantizedTensor, bias: torch.Tensor | None) -> QuantizedKernel:
    """The kernel for a quantized weight's mode."""
    return Int8Kernel(weight, bias) if weight.mode == "int8" else Int4Kernel(weight, bias)

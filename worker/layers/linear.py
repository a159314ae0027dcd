"""Linear layers that run a chosen kernel (`linear_kernels.py`, or weight-only quantized),
and fused (packed) projections."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers import native
from worker.layers.changes import note_change
from worker.layers.handles import handle_of
from worker.layers.linear_kernels import LinearKernel
from worker.layers.quant import (
    GroupInt8Kernel,
    QuantizedKernel,
    QuantizedTensor,
    build_quantized_kernel,
    concat_rows,
    convert,
    quantize,
    quantize_int8_groups,
)


class Linear(nn.Linear):
    """nn.Linear whose 2-D products go through a kernel picked at load (plain by default).

    The plain `weight` stays (tied embeddings, state_dict, kernels built from it). Under
    `torch.compile` the kernel is called through the opaque op `ladle::linear` with its
    handle in a 0-d buffer: a tensor, unlike an int attribute, is a graph input rather than
    a constant, so every layer reuses one compiled graph.
    """

    kernel: LinearKernel | None = None
    kernel_id: torch.Tensor | None
    quantized: QuantizedKernel | None = None
    # shard index -> quantized checkpoint tensor, held until `quantize_rows` packs them
    pending_quantized: dict[int, QuantizedTensor] | None = None

    @property
    def shard_row_sizes(self) -> list[int]:
        return [self.out_features]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("kernel_id", None, persistent=False)

    def set_kernel(self, kernel: LinearKernel | None) -> None:
        """Use `kernel` for 2-D inputs from now on (None: plain `F.linear`)."""
        self.kernel = kernel
        self.kernel_id = None if kernel is None else torch.tensor(handle_of(kernel))
        note_change()

    def load_quantized(self, shard_index: int, tensor: QuantizedTensor) -> None:
        """Keep a quantized checkpoint tensor for shard `shard_index` until `quantize_rows`."""
        size = self.shard_row_sizes[shard_index]
        if tensor.shape[0] != size or tensor.shape[1] != self.in_features:
            raise ValueError(
                f"quantized shard {shard_index} is {tuple(tensor.shape)}, "
                f"expected ({size}, {self.in_features})"
            )
        if self.pending_quantized is None:
            self.pending_quantized = {}
        self.pending_quantized[shard_index] = tensor

    def quantize_rows(self, mode: str) -> None:
        """Compute with `mode` weights from now on and free the float weight.

        Each shard comes from its quantized checkpoint tensor where one was loaded (converted
        if its format differs), else from the float rows loaded into `weight`.
        """
        pending = self.pending_quantized or {}
        parts, start = [], 0
        for index, size in enumerate(self.shard_row_sizes):
            if index in pending:
                parts.append(convert(pending[index], mode))
            else:
                parts.append(quantize(self.weight[start : start + size], mode))
            start += size
        bias = None if self.bias is None else self.bias.detach()
        self.quantized = build_quantized_kernel(concat_rows(parts), bias)
        self.set_kernel(self.quantized)  # for good: the autotuner leaves quantized layers be
        self.pending_quantized = None
        empty = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
        self.weight = nn.Parameter(empty, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # inputs are 2-D in the compiled (flat) forward
            if self.kernel_id is None:
                return F.linear(x, self.weight, self.bias)
            return torch.ops.ladle.linear(x, self.kernel_id, self.out_features)
        kernel = self.kernel
        if kernel is None:
            return F.linear(x, self.weight, self.bias)
        if x.dim() == 2:
            return kernel(x)
        return kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], -1)


class PackedLinear(Linear):
    """One matmul for several projections; checkpoint shards are copied into row ranges."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    @property
    def shard_row_sizes(self) -> list[int]:
        return self.shard_sizes

    def load_shard(
        self, param: nn.Parameter, shard_index: int, tensor: torch.Tensor | QuantizedTensor
    ) -> None:
        """Copy one checkpoint tensor (q, k, v, gate or up) into its rows of `param`."""
        if isinstance(tensor, QuantizedTensor) and param is self.weight:
            self.load_quantized(shard_index, tensor)
            return
        start = sum(self.shard_sizes[:shard_index])
        size = self.shard_sizes[shard_index]
        if tensor.shape[0] != size:
            raise ValueError(f"shard {shard_index} has {tensor.shape[0]} rows, expected {size}")
        param.data[start : start + size].copy_(tensor)


ROUTERS = ("gate", "shared_expert_gate")  # MoE routers: tiny, and they pick the experts


def file_mode(module: Linear) -> str:
    """The mode "auto" serves a layer in: its checkpoint tensors' own (int8 where its shards
    differ), "none" where it loaded float weights only."""
    modes = {tensor.mode for tensor in (module.pending_quantized or {}).values()}
    return "int8" if "int8" in modes else "int4" if modes else "none"


def quantize_linears(
    model: nn.Module, mode: str, keep: tuple[str, ...] = ("lm_head", *ROUTERS)
) -> int:
    """Quantize every `Linear` of `model` but those named in `keep` to `mode` ("auto": each
    to `file_mode`); returns how many were.

    The lm_head stays in the model dtype: it is often tied to the embeddings, and its
    rounding moves every logit (llama.cpp keeps a wider type for it too); so do MoE routers
    (llama.cpp keeps `ffn_gate_inp` in float32), whose rounding would change expert choices.
    """
    linears = [
        module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rsplit(".", 1)[-1] not in keep
    ]
    count = 0
    for module in linears:
        chosen = file_mode(module) if mode == "auto" else mode
        if chosen != "none":
            module.quantize_rows(chosen)
            count += 1
    return count


LM_HEAD_MODES = ("auto", "none", "int8")
# Where a checkpoint keeps the lm_head's weight, or the embeddings a tied one shares.
HEAD_SOURCE_NAMES = ("lm_head.weight", "model.embed_tokens.weight")


def head_sources(
    weights: Iterator[tuple[str, object]], keep: dict[str, torch.Tensor]
) -> Iterator[tuple[str, object]]:
    """`weights` unchanged, keeping the float tensors of `HEAD_SOURCE_NAMES` in `keep`."""
    for name, tensor in weights:
        if name in HEAD_SOURCE_NAMES and isinstance(tensor, torch.Tensor):
            keep[name] = tensor
        yield name, tensor


def has_quantized_projections(model: nn.Module) -> bool:
    """Whether any projection other than the lm_head is served quantized."""
    return any(
        isinstance(module, Linear) and module.quantized is not None
        for name, module in model.named_modules()
        if name != "lm_head"
    )


def quantize_lm_head(
    model: nn.Module, mode: str, sources: dict[str, torch.Tensor] | None = None
) -> bool:
    """Serve the lm_head in int8 (groups of 32, `GroupInt8Kernel`) for `mode` "int8", or for
    "auto" where the projections are quantized; returns whether it is. A tied lm_head keeps
    its float weight: the embeddings read it.

    `sources` (checkpoint name -> tensor as the checkpoint held it, `head_sources`) gives
    the weight before its cast to the model's dtype: a GGUF's Q8_0 output or embedding,
    dequantized to float32, quantizes back to the file's own integers and scales exactly.

    One decode step reads the whole lm_head (49152 x 576 on SmolLM2: a fifth of the step's
    4-bit bytes in bf16); int8 halves that and keeps 8 bits, as llama.cpp keeps the output
    of its 4-bit files in Q6_K or Q8_0. Only Ladle's native kernel serves it.
    """
    if mode not in LM_HEAD_MODES:
        raise ValueError(f"unknown lm_head quantization {mode!r}; use {', '.join(LM_HEAD_MODES)}")
    head = getattr(model, "lm_head", None)
    wanted = mode == "int8" or (mode == "auto" and has_quantized_projections(model))
    if not wanted or not isinstance(head, Linear) or head.quantized is not None:
        return False
    weight = head.weight
    if weight.device.type != "cpu" or not (
        native.int8_packable(*weight.shape) or native.int8_f32_packable(*weight.shape)
    ):
        return False
    bias = None if head.bias is None else head.bias.detach()
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if p is weight}
    source = next((sources[n] for n in sorted(names) if n in (sources or {})), None)
    if source is None or tuple(source.shape) != tuple(weight.shape):
        source = weight
    head.quantized = GroupInt8Kernel(quantize_int8_groups(source), bias)
    head.set_kernel(head.quantized)
    others = model.named_parameters(remove_duplicate=False)
    if not any(param is weight for name, param in others if name != "lm_head.weight"):
        empty = torch.empty(0, dtype=weight.dtype, device=weight.device)
        head.weight = nn.Parameter(empty, requires_grad=False)
    return True

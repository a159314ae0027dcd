"""A GGUF's quantized linears read straight into our int8/int4 layers, not through float.

Q4_0 and Q4_1 blocks (32 weights, an fp16 scale `d`, for Q4_1 an fp16 minimum `m`, 16 bytes
of nibbles: low nibbles are weights 0-15, high nibbles 16-31) become int4 `QuantizedTensor`s
with the same integers and group size: w = q * d + m, or (q - 8) * d for Q4_0. Every other
case is requantized from the tensor's float32 values: Q8_0 for int8 (one scale per 32 weights
there, one per row in `_weight_int8pack_mm`), Q4_x for int8, Q8_0 and float tensors for int4.
Non-linear tensors (embeddings, norms) and the lm_head come back as float32 tensors; the
loader keeps them in the model dtype.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker.layers.quant import QuantizedTensor, quantize
from worker.models.gguf_convert import dequantized, float_tensor, gguf_entries, unpermute_qk

Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (+ fp16 m) + 16 bytes of nibbles
Q4_BLOCK = 32


def is_linear_weight(name: str) -> bool:
    """True for the projections we quantize (not embeddings, norms or the lm_head)."""
    return name.endswith("_proj.weight")


def q4_to_int4(data: np.ndarray, kind: str) -> QuantizedTensor:
    """Q4_0/Q4_1 rows (uint8 [rows, blocks * block bytes]) as the same int4 integers."""
    block_bytes = Q4_BLOCK_BYTES[kind]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == "Q4_1":
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        mins = -8 * scales
    nibbles = blocks[..., block_bytes - 16 :]
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    return QuantizedTensor(
        "int4", torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(mins)
    )


def quantized_linear(tensor: Any, mode: str) -> QuantizedTensor:
    """One GGUF linear weight in `mode`: its own integers where the format maps."""
    kind = tensor.tensor_type.name
    if mode == "int4" and kind in Q4_BLOCK_BYTES:
        return q4_to_int4(np.asarray(tensor.data), kind)
    return quantize(torch.from_numpy(np.array(dequantized(tensor))), mode)


def _row_order(rows: int, heads: int) -> torch.Tensor:
    """The row permutation that `unpermute_qk` applies, as indices."""
    return torch.from_numpy(unpermute_qk(np.arange(rows)[:, None], heads)[:, 0].copy())


def gguf_quantized_weights(
    path: Path, config: dict, mode: str
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, float32 tensor or `mode` QuantizedTensor) for every tensor of the file."""
    for name, tensor, heads in gguf_entries(path, config):
        if is_linear_weight(name):
            weight = quantized_linear(tensor, mode)
            if heads is not None:
                weight = weight.rows(_row_order(weight.shape[0], heads))
            yield name, weight
        else:
            array = float_tensor(name, tensor, heads, config["model_type"])
            yield name, torch.from_numpy(np.array(array, dtype=np.float32, order="C"))

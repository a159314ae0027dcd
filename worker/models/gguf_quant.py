"""A GGUF's quantized linears read straight into our int8/int4 layers, not through float.

Q4_0, Q4_1 and Q4_K map exactly onto the int4 kernel's groups of 32 (w = q s + m, s and m
in float32), with the file's own integers:

* Q4_0 (32 weights: fp16 d, 16 bytes of nibbles, low nibbles are weights 0-15): s = d,
  m = -8 d;
* Q4_1 (fp16 d and m before the nibbles): s = d, m = m;
* Q4_K (256 weights: fp16 d and dmin, 12 bytes of 6-bit sub-block scales sc and mins mb,
  128 bytes of nibbles, sub-blocks 2i and 2i+1 the low and high nibbles of bytes 32i..32i+31):
  per sub-block of 32, s = d sc and m = -dmin mb. Both products are exact in float32 (11 x 6
  significant bits), and q s + m rounds once, as gguf's own dequantizer does.

Every other type is requantized from its float32 values. `AUTO_MODES` says what
`quantization="auto"` serves each type as: 4-bit files in int4, 5-8-bit ones in int8, float
ones in the model dtype. Non-linear tensors (embeddings, norms, routers) and the lm_head come
back as float32 tensors; the loader keeps them in the model dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from worker.layers.quant import QuantizedTensor, quantize
from worker.models.gguf_convert import (
    GGUFPiece,
    dequantized,
    float_tensor,
    gguf_entries,
    unpermute_qk,
)

Q4_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}  # fp16 d (+ fp16 m) + 16 bytes of nibbles
Q4_K_BLOCK_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of scales and mins, 128 of nibbles
INT4_EXACT = ("Q4_0", "Q4_1", "Q4_K")
# What "auto" serves each GGUF type of a linear weight as ("none": the model dtype).
AUTO_MODES = {
    **dict.fromkeys(("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"), "int4"),
    **dict.fromkeys(("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"), "int8"),
    **dict.fromkeys(("F32", "F16", "BF16"), "none"),
}


def is_linear_weight(name: str) -> bool:
    """True for the projections we quantize (not embeddings, norms, routers or the lm_head)."""
    return name.endswith("_proj.weight")


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def q4_to_int4(data: np.ndarray, kind: str) -> QuantizedTensor:
    """Q4_0/Q4_1 rows (uint8 [rows, blocks * block bytes]) as the same int4 integers."""
    block_bytes = Q4_BLOCK_BYTES[kind]
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, block_bytes)
    scales = _fp16(blocks, 0)
    mins = _fp16(blocks, 2) if kind == "Q4_1" else -8 * scales
    nibbles = blocks[..., block_bytes - 16 :]
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    return QuantizedTensor(
        "int4", torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(mins)
    )


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes per block -> 8 six-bit scales and 8 six-bit mins, as integers."""
    low, high, mixed = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def q4_k_to_int4(data: np.ndarray) -> QuantizedTensor:
    """Q4_K rows (uint8 [rows, blocks * 144]) as int4 groups of 32: the same integers, each
    sub-block's scale d * sc and min -dmin * mb (exact in float32)."""
    rows = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(rows, -1, Q4_K_BLOCK_BYTES)
    sc, mb = _k_scales_mins(blocks[..., 4:16])
    scales = (_fp16(blocks, 0)[..., None] * sc).reshape(rows, -1)
    mins = -(_fp16(blocks, 2)[..., None] * mb).reshape(rows, -1)
    nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # 4 pairs of sub-blocks
    values = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=3).reshape(rows, -1)
    return QuantizedTensor(
        "int4", torch.from_numpy(values), torch.from_numpy(scales), torch.from_numpy(mins)
    )


def linear_mode(kind: str, mode: str) -> str:
    """The mode a linear weight of GGUF type `kind` is served in under `mode`."""
    return AUTO_MODES.get(kind, "int4") if mode == "auto" else mode


def quantized_linear(piece: GGUFPiece, mode: str) -> QuantizedTensor | None:
    """One GGUF linear weight in `mode` (None: keep it as float): its own integers where the
    format maps exactly, else requantized from its float32 values."""
    mode = linear_mode(piece.kind, mode)
    if mode == "none":
        return None
    if mode == "int4" and piece.kind == "Q4_K":
        return q4_k_to_int4(np.asarray(piece.data))
    if mode == "int4" and piece.kind in Q4_BLOCK_BYTES:
        return q4_to_int4(np.asarray(piece.data), piece.kind)
    return quantize(torch.from_numpy(np.array(dequantized(piece))), mode)


def _row_order(rows: int, heads: int) -> torch.Tensor:
    """The row permutation that `unpermute_qk` applies, as indices."""
    return torch.from_numpy(unpermute_qk(np.arange(rows)[:, None], heads)[:, 0].copy())


def gguf_quantized_weights(
    path: Path, config: dict, mode: str, converted: Path | None = None
) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """(HF name, float32 tensor or QuantizedTensor) for every tensor of the file, linears in
    `mode` ("int8", "int4", or "auto": per tensor, as `AUTO_MODES` says).

    Float tensors come from `converted` (the file's float32 conversion, the same values)
    where it holds them: dequantizing the embeddings with numpy cost ~0.6 s of every start."""
    arch = config["model_type"]
    with contextlib.ExitStack() as stack:
        floats = _float_tensors(converted, stack)
        for name, piece in gguf_entries(path, config):
            weight = quantized_linear(piece, mode) if is_linear_weight(name) else None
            if weight is None:
                yield name, _float_weight(name, piece, arch, floats)
                continue
            if piece.heads is not None:
                weight = weight.rows(_row_order(weight.shape[0], piece.heads))
            yield name, weight


def _float_tensors(converted: Path | None, stack: contextlib.ExitStack) -> dict[str, Any]:
    """HF name -> the open safetensors file of `converted` that holds it."""
    if converted is None:
        return {}
    found: dict[str, Any] = {}
    for file in sorted(converted.glob("*.safetensors")):
        handle = stack.enter_context(safe_open(str(file), framework="pt"))
        found.update(dict.fromkeys(handle.keys(), handle))
    return found


def _float_weight(name: str, piece: GGUFPiece, arch: str, floats: dict[str, Any]) -> torch.Tensor:
    if name in floats:
        saved = floats[name].get_tensor(name)
        if saved.dtype == torch.float32 and tuple(saved.shape) == tuple(piece.shape):
            return saved
    array = float_tensor(name, piece, arch)
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))

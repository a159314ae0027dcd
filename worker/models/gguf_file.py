"""A GGUF file's tensors, found without decoding its metadata values.

gguf's `GGUFReader` turns every metadata value into numpy views, one per array element: for
a file that carries its tokenizer (49,152 tokens and as many merges for SmolLM2) that is
~1.2 million memmap slices, seconds of every start that loads weights from the file
(docs/benchmarks.md, "Start-up"). Loading weights needs only the tensor index, so this
reader steps over the values by their lengths and memory-maps each tensor's bytes as gguf
does (same dtypes and shapes). Anything it does not expect (another byte order or version)
goes to gguf's own reader.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value type -> struct format of its scalar (8: string, 9: array)
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_PLAIN_DTYPES = {  # ggml types stored as plain numbers, like gguf's reader
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


@dataclass
class GGUFTensor:
    """The attributes of gguf's `ReaderTensor` that loading uses."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order (fastest-varying first), as gguf reports it
    n_bytes: int
    data: np.ndarray  # read-only view of the file: typed values, or uint8 rows of blocks


class _Cursor:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        self.offset += length
        return self.buffer[self.offset - length : self.offset].decode("utf-8")

    def skip_value(self, kind: int) -> Any:
        """Step over one value; return it if it is a scalar (arrays and strings: None)."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            length = self.scalar("Q")  # read first: it moves the offset
            self.offset += length
            return None
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.scalar("I"), self.scalar("Q")
        if item_kind in _SCALARS:
            self.offset += count * struct.calcsize(_SCALARS[item_kind])
        else:
            for _ in range(count):
                self.skip_value(item_kind)
        return None


def read_tensors(path: Path) -> list[Any]:
    """Every tensor of the GGUF at `path`, its data memory-mapped, in file order."""
    with path.open("rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    cursor = _Cursor(buffer)
    if buffer[:4] != GGUF_MAGIC or struct.unpack_from("<I", buffer, 4)[0] not in SUPPORTED_VERSIONS:
        return _read_with_gguf(path)
    cursor.offset = 8
    num_tensors, num_fields = cursor.scalar("Q"), cursor.scalar("Q")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key, kind = cursor.string(), cursor.scalar("I")
        value = cursor.skip_value(kind)
        if key == "general.alignment":
            alignment = int(value)
    infos = [_tensor_info(cursor) for _ in range(num_tensors)]
    data_start = -(-cursor.offset // alignment) * alignment
    file_array = np.frombuffer(buffer, dtype=np.uint8)
    return [_tensor(file_array, data_start, *info) for info in infos]


def _tensor_info(cursor: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cursor.string()
    dims = tuple(cursor.scalar("Q") for _ in range(cursor.scalar("I")))
    return name, dims, cursor.scalar("I"), cursor.scalar("Q")


def _tensor(
    file_array: np.ndarray, data_start: int, name: str, dims: tuple[int, ...], kind: int, at: int
) -> GGUFTensor:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    tensor_type = GGMLQuantizationType(kind)
    block_size, type_size = GGML_QUANT_SIZES[tensor_type]
    num_elements = int(np.prod(dims))
    n_bytes = num_elements * type_size // block_size
    start = data_start + at
    raw = file_array[start : start + n_bytes]
    shape = tuple(reversed(dims))
    dtype = _PLAIN_DTYPES.get(tensor_type.name)
    if dtype is not None:
        data = raw.view(dtype).reshape(shape)
    else:  # rows of blocks, as gguf's reader shapes them
        data = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
    return GGUFTensor(name, tensor_type, dims, n_bytes, data)


def _read_with_gguf(path: Path) -> list[Any]:
    from gguf import GGUFReader

    return list(GGUFReader(str(path)).tensors)

"""One-time conversion of a GGUF file into a Hugging Face directory (config, safetensors,
tokenizer), written atomically so that later starts load the directory directly.

The config and tokenizer come from transformers' GGUF readers; tensors are dequantised with
the `gguf` package, renamed to HF names (`gguf_names.py`), and llama.cpp's Q/K row
permutation is undone; what transformers' config reader leaves out comes from the file's
metadata (`gguf_config.py`).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from worker.models.errors import ModelConfigError
from worker.models.gguf_config import complete_config, own_config
from worker.models.gguf_file import read_tensors
from worker.models.gguf_names import CONFIG_TENSORS, hf_name, is_expert_stack
from worker.models.registry import MODEL_TYPES

log = logging.getLogger(__name__)

# transformers' model_type for each GGUF arch we serve (gemma3's is gemma3_text; a llama
# file with experts is Mixtral)
SUPPORTED_GGUF_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
)
# Architectures whose Q/K rows llama.cpp permuted at conversion.
PERMUTED_ARCHS = ("llama", "mistral", "mixtral")
# Architectures whose norm weights llama.cpp stored as 1 + w (Gemma's form, made plain).
PLUS_ONE_NORM_ARCHS = ("gemma2", "gemma3_text")


@dataclass
class GGUFPiece:
    """One HF tensor's part of a GGUF tensor: all of it, or one expert of a stack."""

    tensor: Any  # gguf's ReaderTensor, or the same fields (`gguf_file.GGUFTensor`)
    data: np.ndarray  # its raw data (uint8 blocks, or floats), this piece only
    shape: tuple[int, ...]  # HF's row-major shape of this piece
    heads: int | None = None  # heads whose Q/K row interleaving to undo

    @property
    def kind(self) -> str:
        return self.tensor.tensor_type.name


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary halves in Q/K rows."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _permuted_heads(name: str, config: dict) -> int | None:
    if config["model_type"] not in PERMUTED_ARCHS:
        return None
    if ".attn_q." in name:
        return config["num_attention_heads"]
    if ".attn_k." in name:
        return config["num_key_value_heads"]
    return None


def gguf_entries(path: Path, config: dict) -> Iterator[tuple[str, GGUFPiece]]:
    """(HF name, its piece of a GGUF tensor) for every weight in the file."""
    arch = config["model_type"]
    for tensor in read_tensors(path):
        if tensor.name in CONFIG_TENSORS:
            continue
        shape = tuple(reversed([int(n) for n in tensor.shape]))
        if not is_expert_stack(tensor.name):
            piece = GGUFPiece(tensor, tensor.data, shape, _permuted_heads(tensor.name, config))
            yield hf_name(tensor.name, arch), piece
            continue
        for expert in range(shape[0]):
            piece = GGUFPiece(tensor, tensor.data[expert], shape[1:])
            yield hf_name(tensor.name, arch, expert), piece


def dequantized(piece: GGUFPiece) -> np.ndarray:
    """A GGUF piece as float32, in HF's row-major shape ([out, in] for a weight)."""
    from gguf.quants import dequantize

    array = dequantize(piece.data, piece.tensor.tensor_type).astype(np.float32, copy=False)
    return array.reshape(piece.shape)


def float_tensor(name: str, piece: GGUFPiece, arch: str) -> np.ndarray:
    """A GGUF piece as HF's float32 values: dequantised, llama.cpp's Q/K permutation and
    Gemma's stored 1 + w undone."""
    array = dequantized(piece)
    if piece.heads is not None:
        array = unpermute_qk(array, piece.heads)
    if arch in PLUS_ONE_NORM_ARCHS and name.endswith("norm.weight"):
        array = array - 1.0
    if name.endswith("shared_expert_gate.weight"):
        array = array.reshape(1, -1)  # a vector in the file, HF's Linear(hidden, 1)
    return array


def gguf_tensors(path: Path, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor in the file, as HF holds it."""
    for name, piece in gguf_entries(path, config):
        yield name, float_tensor(name, piece, config["model_type"])


def _read_config(gguf_path: Path, reader: Any) -> dict:
    """The file's config as transformers reads it, or as we do where transformers cannot."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError) as exc:  # transformers cannot read this architecture
        values = own_config(reader)
        if values is not None:
            return values
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelConfigError(f"cannot read GGUF {gguf_path.name}: {first_line}") from exc
    return config.to_dict()


def _write_config(gguf_path: Path, out: Path) -> dict:
    from gguf import GGUFReader
    from transformers import AutoConfig

    reader = GGUFReader(str(gguf_path))
    values = _read_config(gguf_path, reader)
    model_type = values["model_type"]
    values = complete_config(values, reader)
    if values["model_type"] != model_type:  # a llama file with experts: Mixtral
        values.pop("architectures", None)
    config = AutoConfig.for_model(**values)
    if config.model_type not in SUPPORTED_GGUF_ARCHS:
        raise ModelConfigError(
            f"unsupported GGUF architecture {config.model_type!r}; "
            f"supported: {', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    config.architectures = [MODEL_TYPES[config.model_type]]
    config.save_pretrained(str(out))
    generation = {
        key: getattr(config, key)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(config, key, None) is not None
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return config.to_dict()


def _write_tokenizer(gguf_path: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out))


def _write_weights(gguf_path: Path, out: Path, config: dict, dtype: torch.dtype) -> None:
    tensors = {
        name: torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)
        for name, array in gguf_tensors(gguf_path, config)
    }
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _make_readable(directory: Path) -> None:
    """mkdtemp makes a private directory; the converted model is shared like any cache."""
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    dtype: torch.dtype = torch.float32,
    with_tokenizer: bool = True,
) -> Path:
    """Write the HF directory for `gguf_path` at `out_dir` (tmp dir, then rename);
    `with_tokenizer=False` for a file without one (tests' tiny models)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        config = _write_config(gguf_path, tmp)
        if with_tokenizer:
            _write_tokenizer(gguf_path, tmp)
        _write_weights(gguf_path, tmp, config, dtype)
        _make_readable(tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "model.safetensors").exists():
                raise
            log.info("another process converted %s first", gguf_path.name)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir

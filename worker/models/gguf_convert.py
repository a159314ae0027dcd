"""One-time conversion of a GGUF file into a Hugging Face directory (config, safetensors,
tokenizer), written atomically so that later starts load the directory directly.

The config and tokenizer come from transformers' GGUF readers; tensors are dequantised with
the `gguf` package, renamed to HF names, and llama.cpp's Q/K row permutation is undone.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from worker.models.errors import ModelConfigError
from worker.models.registry import MODEL_TYPES

log = logging.getLogger(__name__)

# transformers' model_type for each GGUF arch we serve (gemma3's is gemma3_text)
SUPPORTED_GGUF_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
# Architectures whose Q/K rows llama.cpp permuted at conversion.
PERMUTED_ARCHS = ("llama", "mistral")
# Architectures whose norm weights llama.cpp stored as 1 + w (Gemma's form, made plain).
PLUS_ONE_NORM_ARCHS = ("gemma2", "gemma3_text")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, and two more after
_GEMMA_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_NAMES_BY_ARCH = {"gemma2": _GEMMA_BLOCK_NAMES, "gemma3_text": _GEMMA_BLOCK_NAMES}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """The HF parameter name for a GGUF tensor name (of a file of transformers' `arch`)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _BLOCK_NAMES_BY_ARCH.get(arch, _BLOCK_NAMES)
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is None or match.group(2) not in names:
        raise ModelConfigError(f"unknown GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{names[part]}.{kind}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head interleaving of rotary halves in Q/K rows."""
    half = weight.shape[0] // num_heads // 2
    rows = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def gguf_entries(path: Path, config: dict) -> Iterator[tuple[str, Any, int | None]]:
    """(HF name, GGUF tensor, heads whose Q/K row interleaving to undo or None) per tensor."""
    from gguf import GGUFReader

    arch = config["model_type"]
    for tensor in GGUFReader(str(path)).tensors:
        heads = None
        if arch in PERMUTED_ARCHS and ".attn_q." in tensor.name:
            heads = config["num_attention_heads"]
        elif arch in PERMUTED_ARCHS and ".attn_k." in tensor.name:
            heads = config["num_key_value_heads"]
        yield hf_name(tensor.name, arch), tensor, heads


def dequantized(tensor: Any) -> np.ndarray:
    """A GGUF tensor as float32, in HF's row-major shape ([out, in] for a weight)."""
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
    return array.reshape(tuple(reversed([int(n) for n in tensor.shape])))


def float_tensor(name: str, tensor: Any, heads: int | None, arch: str) -> np.ndarray:
    """A GGUF tensor as HF's float32 values: dequantised, llama.cpp's Q/K permutation and
    Gemma's stored 1 + w undone."""
    array = dequantized(tensor)
    if heads is not None:
        array = unpermute_qk(array, heads)
    if arch in PLUS_ONE_NORM_ARCHS and name.endswith("norm.weight"):
        array = array - 1.0
    return array


def gguf_tensors(path: Path, config: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor in the file, as HF holds it."""
    for name, tensor, heads in gguf_entries(path, config):
        yield name, float_tensor(name, tensor, heads, config["model_type"])


def _write_config(gguf_path: Path, out: Path) -> dict:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (ValueError, KeyError) as exc:  # transformers cannot read this architecture
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelConfigError(f"cannot read GGUF {gguf_path.name}: {first_line}") from exc
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


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the HF directory for `gguf_path` at `out_dir` (tmp dir, then rename)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        config = _write_config(gguf_path, tmp)
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

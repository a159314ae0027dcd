"""The tensor index read past a GGUF's metadata is gguf's own: names, types, shapes, bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from worker.models.gguf_file import read_tensors


def _write(path: Path, alignment: int | None) -> None:
    import gguf

    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    # every kind of value the reader must step over: strings, arrays of strings and numbers
    writer.add_string("general.name", "tiny ünïcode")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "ä", "", "a" * 300])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 3.0])
    writer.add_array("tokenizer.ggml.token_type", [1, 2, 3, 4])
    writer.add_uint32("llama.context_length", 64)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_float64("some.double", 1.5)
    for index, kind in enumerate(("F32", "F16", "Q8_0", "Q4_1", "Q4_K")):
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (8, 256 // block * size), dtype=np.uint8)  # raw blocks
        if kind in ("F32", "F16"):
            data = rng.standard_normal((8, 256)).astype(np.float32 if kind == "F32" else np.float16)
        writer.add_tensor(f"blk.{index}.ffn_down.weight", data, raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", rng.standard_normal(256).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_tensors_are_ggufs_own(tmp_path: Path, alignment: int | None) -> None:
    from gguf import GGUFReader

    path = tmp_path / "tiny.gguf"
    _write(path, alignment)
    ours, theirs = read_tensors(path), GGUFReader(str(path)).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.tensor_type == reference.tensor_type, mine.name
        assert mine.shape == tuple(int(n) for n in reference.shape), mine.name
        assert mine.n_bytes == reference.n_bytes, mine.name
        assert mine.data.dtype == reference.data.dtype, mine.name
        np.testing.assert_array_equal(mine.data, reference.data, err_msg=mine.name)

"""The kernel benchmarks in loadtest/ run on this CPU's kernels (bf16 ones where it has
AVX512-BF16, the float32 ones on AVX2), at their smallest sizes."""

from __future__ import annotations

import pytest

from loadtest import attention_rows, int4_stream
from worker.layers import native

pytestmark = pytest.mark.skipif(not native.load(None), reason="native kernels unavailable")


def test_int4_stream_times_the_kernel_this_cpu_decodes_with(capsys: pytest.CaptureFixture) -> None:
    assert int4_stream.main(["--threads", "1", "--layers", "1", "--reps", "1"]) == 0
    out = capsys.readouterr().out
    assert "threads 1: 4 calls" in out
    assert out.count("in cache:") == len(int4_stream.SHAPES)


def test_int4_stream_times_each_kernel_it_is_asked_for(capsys: pytest.CaptureFixture) -> None:
    kernels = [*native.int4_kernels_here(), "f32"]  # every CPU here has the AVX2 one
    args = ["--threads", "1", "--layers", "1", "--reps", "1", "--kernel", *kernels]
    assert int4_stream.main(args) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("kernel ")] == [
        f"kernel {name}:" for name in kernels
    ]
    assert out.count("in cache:") == len(kernels) * len(int4_stream.SHAPES)


def test_attention_rows_compares_with_sdpa_in_the_engines_dtype(
    capsys: pytest.CaptureFixture,
) -> None:
    attention_rows.main("--prefill 32 --decode 2 --threads 1 --keys packed --context 32".split())
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1 |")]
    assert len(rows) == 2
    error = float(rows[0].split("|")[-2])
    assert error < (0.05 if native.bf16() else 1e-4)

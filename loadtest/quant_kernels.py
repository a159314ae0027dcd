"""Time the linear kernels on SmolLM2-135M's shapes: float, int8 and int4, per batch size.

    .venv/bin/python -m loadtest.quant_kernels [--batch 1 4 16 64] [--threads N]

For each candidate, one forward's worth of the model's matmuls (30 layers of fused qkv, o,
gate_up, down; the lm_head is left out: it stays in the model dtype when quantized) is timed,
best of `--repeats`. Candidates: bf16 and float32 `F.linear`, bf16 oneDNN-prepacked, our int8
and int4 kernels with float32, fp16 or bf16 activations, int4 at group sizes 32 and 64.
Prints ms per forward; the fastest activation dtype decides `quant.COMPUTE_DTYPE`.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from loadtest.matmul_bound import SMOLLM2_SHAPES
from worker.layers.quant import Int4Kernel, Int8Kernel, quantize_int4, quantize_int8

LAYER_SHAPES = {k: v for k, v in SMOLLM2_SHAPES.items() if k != "lm_head"}
Kernel = Callable[[torch.Tensor], torch.Tensor]
Builder = Callable[[torch.Tensor], tuple[Kernel, torch.dtype]]


def _float(dtype: torch.dtype) -> Builder:
    def build(w: torch.Tensor) -> tuple[Kernel, torch.dtype]:
        weight = w.to(dtype)
        return (lambda x: F.linear(x, weight)), dtype

    return build


def _prepacked(w: torch.Tensor) -> tuple[Kernel, torch.dtype]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 1)
    pointwise = torch.ops.mkldnn._linear_pointwise
    return (lambda x: pointwise(x, packed, None, "none", [], "")), torch.bfloat16


def _int8(dtype: torch.dtype) -> Builder:
    return lambda w: (Int8Kernel(quantize_int8(w), None, dtype), dtype)


def _int4(dtype: torch.dtype, group: int) -> Builder:
    return lambda w: (Int4Kernel(quantize_int4(w, group), None, dtype), dtype)


CANDIDATES: dict[str, Builder] = {
    "bf16 F.linear": _float(torch.bfloat16),
    "bf16 prepacked": _prepacked,
    "fp32 F.linear": _float(torch.float32),
    "int8 (fp32 act)": _int8(torch.float32),
    "int8 (bf16 act)": _int8(torch.bfloat16),
    "int4 g32 (fp32 act)": _int4(torch.float32, 32),
    "int4 g32 (bf16 act)": _int4(torch.bfloat16, 32),
    "int4 g64 (bf16 act)": _int4(torch.bfloat16, 64),
    "int8 (fp16 act)": _int8(torch.float16),
    "int4 g32 (fp16 act)": _int4(torch.float16, 32),
}


def time_candidate(build: Builder, batch: int, repeats: int) -> float:
    """Best-of-`repeats` seconds for one forward's matmuls at `batch` rows."""
    total = 0.0
    torch.manual_seed(0)
    for in_f, out_f, count in LAYER_SHAPES.values():
        kernel, dtype = build(torch.randn(out_f, in_f) * 0.02)
        x = torch.randn(batch, in_f, dtype=dtype)
        kernel(x)  # warm-up
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            kernel(x)
            best = min(best, time.perf_counter() - started)
        total += best * count
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"load average {os.getloadavg()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; ms per forward (30 layers, no lm_head)"
    )
    print(f"{'kernel':22}" + "".join(f"{f'M={b}':>10}" for b in args.batch))
    with torch.inference_mode():
        for name, build in CANDIDATES.items():
            times = [time_candidate(build, b, args.repeats) * 1e3 for b in args.batch]
            print(f"{name:22}" + "".join(f"{t:10.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()

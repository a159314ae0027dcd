"""The matmul kernels of a float32 model side by side, as a CPU without AVX512-BF16 runs it:
torch's own (`plain`: MKL/oneDNN sgemm, not batch invariant), Ladle's float32 `native`, and
the int4 and int8 kernels on float32 activations (`int4-native-q8`, `int8-q8`: AVX2), plus
torch's int4 kernel (bf16 activations) for scale. Per shape of the default model and row
count; then one decode step's matmuls (its layers' four projections and the lm_head).

    python -m loadtest.float32_kernels [--rows 1,16,64] [--threads 2] [--layers 30]

Best of 5 rounds of `--iters` calls, in ms; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os

import torch

from loadtest.lm_head import best_ms
from worker.layers import native
from worker.layers.linear_kernels import NativeKernel, PlainKernel
from worker.layers.quant import (
    GroupInt8Kernel,
    Int4Kernel,
    quantize,
    quantize_int8_groups,
)

# SmolLM2-135M: qkv, o, gate_up, down (one of 30 layers each), lm_head
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def kernels_for(weight: torch.Tensor) -> dict[str, object]:
    int4 = quantize(weight, "int4")
    found: dict[str, object] = {
        "plain": PlainKernel(weight, None),
        "native": NativeKernel(weight, None),
        "int4-q8": Int4Kernel(int4, None, compute_dtype=torch.float32),
        "int8-q8": GroupInt8Kernel(quantize_int8_groups(weight), None),
    }
    native.configure(False)  # torch's own int4 kernel, as where the native ones are missing
    found["torch-int4"] = Int4Kernel(int4, None)
    native.configure(True)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--layers", type=int, default=30, help="decoder layers per step")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not native.configure(True, None):
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    print(f"native kernels: {native.status()}; {args.threads} threads")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    names = ("plain", "native", "int4-q8", "int8-q8", "torch-int4")
    step = {(name, r): 0.0 for name in names for r in rows}
    print("shape     rows " + " ".join(f"{name:>10}" for name in names) + "  (ms)")
    for shape_name, shape in SHAPES.items():
        weight = torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 0.05
        kernels = kernels_for(weight)
        if kernels["int4-q8"].name != "int4-native-q8":
            raise SystemExit("the float32 int4 kernel did not build here")
        repeat = 1 if shape_name == "lm_head" else args.layers
        for r in rows:
            x = torch.randn(r, shape[1])
            times = {name: best_ms(kernels[name], x, args.iters) for name in names}
            for name in names:
                step[(name, r)] += repeat * times[name]
            cells = " ".join(f"{times[name]:10.3f}" for name in names)
            print(f"{shape_name:9} {r:4d} {cells}", flush=True)
    for r in rows:
        cells = " ".join(f"{step[(name, r)]:10.2f}" for name in names)
        print(f"{'step':9} {r:4d} {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The lm_head's kernels side by side: bf16 (`native`), int8 in groups of 32 (`int8-native`,
LLM_LM_HEAD_QUANTIZATION=int8) and int4 for scale, on one weight shape, per thread and row count.

    python -m loadtest.lm_head [--out 49152] [--in 576] [--rows 1,4,16] [--threads 1,2]

Prints the best of 5 rounds of `--iters` calls, in ms; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

from worker.layers import native
from worker.layers.linear_kernels import NativeKernel
from worker.layers.quant import (
    GroupInt8Kernel,
    build_quantized_kernel,
    quantize,
    quantize_int8_groups,
)


def best_ms(fn, x: torch.Tensor, iters: int) -> float:
    for _ in range(10):
        fn(x)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(iters):
            fn(x)
        best = min(best, (time.perf_counter() - started) / iters * 1e3)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=49152, help="vocabulary (SmolLM2's)")
    parser.add_argument("--in", dest="inputs", type=int, default=576, help="hidden size")
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--iters", type=int, default=100)
    args = parser.parse_args()
    if not native.configure(True, None):
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    weight = torch.randn(args.out, args.inputs, generator=torch.Generator().manual_seed(0)) * 0.05
    weight = weight.to(torch.bfloat16)
    kernels = {
        "bf16": NativeKernel(weight, None),
        "int8-g32": GroupInt8Kernel(quantize_int8_groups(weight), None),
        "int4-g32": build_quantized_kernel(quantize(weight, "int4"), None),
    }
    print("threads rows " + " ".join(f"{name:>9}" for name in kernels) + "  (ms)")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.inputs).to(torch.bfloat16)
            times = [best_ms(kernel, x, args.iters) for kernel in kernels.values()]
            print(f"{threads:7d} {rows:4d} " + " ".join(f"{t:9.2f}" for t in times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

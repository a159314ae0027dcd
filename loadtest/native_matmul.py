"""One forward's matmuls on Ladle's native bf16 kernel, by row count, against the machine's
memory bound: what a decode step of B sequences costs in matmuls alone.

    .venv/bin/python -m loadtest.native_matmul [--rows 1 16 64 1024] [--threads 1 2]

The weights are SmolLM2-135M's shapes (fused qkv, o, gate_up, down per layer x 30, and the
lm_head), every layer its own random tensor, so a pass streams 269 MB as a model's does. For
each row count: the best of 3 passes in ms, GMAC/s, the weight bytes read per second, and the
share of the memory bound (bytes / read bandwidth measured in the same run,
`loadtest/bandwidth_bound.py`). Results are checked bit for bit against one row at a time.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from loadtest.bandwidth_bound import stream_bandwidth
from worker.layers import native

SHAPES = [(832, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def pass_ms(weights: list[torch.Tensor], xs: dict[int, torch.Tensor], rounds: int = 3) -> float:
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for w in weights:
            torch.ops.ladle_native.gemm_bf16(xs[w.shape[1] * 2], w, None, False)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def check_rows(weights: list[torch.Tensor], xs: dict[int, torch.Tensor]) -> None:
    for w in weights[::31]:
        x = xs[w.shape[1] * 2]
        many = torch.ops.ladle_native.gemm_bf16(x, w, None, False)
        last = torch.ops.ladle_native.gemm_bf16(x[-1:], w, None, False)
        if not torch.equal(many[-1:], last):
            raise SystemExit("a row differs from the same row alone: not batch invariant")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 1024])
    p.add_argument("--threads", type=int, nargs="+", default=[os.cpu_count() or 1])
    args = p.parse_args()
    if not native.load():
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    torch.manual_seed(0)
    weights = [
        native.pack_bf16((torch.randn(n, k) * 0.05).to(torch.bfloat16))
        for n, k, count in SHAPES
        for _ in range(count)
    ]
    macs = sum(n * k * count for n, k, count in SHAPES)
    print(f"load average {os.getloadavg()[0]:.1f}; {2 * macs / 1e6:.0f} MB of bf16 weights")
    print("| threads | rows | ms | GMAC/s | GB/s of weights | share of the memory bound |")
    print("|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = stream_bandwidth(threads=threads)
        for rows in args.rows:
            xs = {k: torch.randn(rows, k).to(torch.bfloat16) for k in (576, 1536)}
            check_rows(weights, xs)
            ms = pass_ms(weights, xs)
            bound_ms = 2 * macs / bandwidth * 1e3
            print(
                f"| {threads} | {rows} | {ms:.2f} | {rows * macs / ms / 1e6:.0f} | "
                f"{2 * macs / ms / 1e6:.1f} | {bound_ms / ms:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()

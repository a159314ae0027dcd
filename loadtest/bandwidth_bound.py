"""Memory-bandwidth bound of single-stream decode: weight bytes per token / streamed GB/s.

One decode token reads every projection's weight once (in the layout its kernel uses: a bf16
weight 2 bytes per value, the float32 kernel 4, int8 1 plus scales, int4 half a byte plus
scales and zeros) and one embedding row; at batch 1 nothing else is that large. The bound is
`bandwidth / bytes per token` tokens/s, with the bandwidth measured here and now: the best
of a few float32 `sum`s over a buffer far larger than the caches (read-only, like a GEMV).

    .venv/bin/python -m loadtest.bandwidth_bound [--mib 1024]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from worker.layers.linear import Linear
from worker.layers.linear_kernels import BucketedKernel


def stream_bandwidth(mib: int = 1024, repeats: int = 5, threads: int | None = None) -> float:
    """Read bandwidth in bytes/s: best of `repeats` sums over `mib` MiB of float32."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        buffer = torch.ones(mib * 2**20 // 4)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            buffer.sum()
            best = min(best, time.perf_counter() - started)
        return buffer.numel() * 4 / best
    finally:
        torch.set_num_threads(previous)


def _tensor_bytes(obj: object) -> int:
    """Bytes of the tensors a kernel object holds (mkldnn tensors counted by their size)."""
    total = 0
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
    return total


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes one single-token step reads: each projection (lm_head included) as its batch-1
    kernel holds it (quantized: integers, scales and zeros), plus one embedding row."""
    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        kernel = module.kernel
        if isinstance(kernel, BucketedKernel):
            kernel = kernel.choices[0][1]
        held = _tensor_bytes(kernel) if kernel is not None else 0
        total += held or module.weight.numel() * module.weight.element_size()
    hidden = model.config.hidden_size
    return total + hidden * next(model.parameters()).element_size()  # one embedding row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    args = parser.parse_args()
    print(f"stream read: {stream_bandwidth(args.mib) / 1e9:.1f} GB/s, load {os.getloadavg()}")


if __name__ == "__main__":
    main()

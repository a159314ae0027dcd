"""How fast the native int4 kernel streams a decode step's projections (M = 1).

    .venv/bin/python -m loadtest.int4_stream [--threads 1 2] [--layers 30] [--reps 20]
                                             [--kernel auto|avx512|vnni|amx|f32 ...]

Packs random int4 weights of SmolLM2-135M's projection shapes (fused qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) for `--layers` layers, then times one pass over all of
them in model order, so each call reads its weights from memory as a decode step does
(80 MB for 30 layers, past any cache). Reported per thread count: ms per pass and GB/s of
packed bytes, beside a plain `torch.sum` over as many bytes (what one read of memory costs
here) and each shape timed alone on one weight (in cache: the kernel's own rate).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from worker.layers import native

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def packed_layers(
    num_layers: int, pack: Callable[..., torch.Tensor]
) -> list[tuple[torch.Tensor, int, int]]:
    layers = []
    for _ in range(num_layers):
        for n, k in SHAPES:
            values = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            scales = torch.rand(n, k // 32) * 0.01
            mins = -torch.rand(n, k // 32) * 0.05
            layers.append((pack(values, scales, mins), n, k))
    return layers


def kernel(name: str = "auto") -> tuple[object, torch.dtype, Callable[..., torch.Tensor]]:
    """An int4 op, its x dtype and the packing it reads: `avx512` (bf16 x on `vdpbf16ps`),
    `vnni` (bf16 x quantized to int8, `vpdpbusd`), `amx` (bf16 x on the tiles), `f32` (float32
    x quantized to int8, AVX2); `auto` the one decode runs here (`LLM_INT4_KERNEL`)."""
    if name == "auto":
        name = native.int4_kernel(3072, 576) if native.bf16() else "f32"
    ops = torch.ops.ladle_native
    if name in ("avx512", "amx"):
        return functools.partial(ops.gemm_int4, amx=name == "amx"), torch.bfloat16, native.pack_int4
    if name == "vnni":
        return ops.gemm_int4_q8, torch.bfloat16, native.pack_int4_q8
    return ops.gemm_int4_f32, torch.float32, native.pack_int4_q8


def one_pass(
    gemm: object, layers: list[tuple[torch.Tensor, int, int]], xs: dict[int, torch.Tensor]
) -> None:
    for packed, n, k in layers:
        gemm(xs[k], packed, n, None)


def timed(fn, reps: int) -> float:  # noqa: ANN001 - any callable
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.int4_stream", description=__doc__)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--kernel", nargs="+", default=["auto"], choices=["auto", "avx512", "vnni", "amx", "f32"]
    )
    args = parser.parse_args(argv)
    if not native.configure(True):
        print(f"native kernels unavailable: {native.status()}")
        return 1
    for name in args.kernel:
        print(f"kernel {name}:")
        stream(*kernel(name), args)
    return 0


def stream(
    gemm: object, dtype: torch.dtype, pack: Callable[..., torch.Tensor], args: argparse.Namespace
) -> None:
    layers = packed_layers(args.layers, pack)
    xs = {k: torch.randn(1, k).to(dtype) for k in (576, 1536)}
    total = sum(packed.numel() for packed, _, _ in layers)
    floats = [torch.randn(total // 4 // 8) for _ in range(8)]
    for threads in args.threads:
        torch.set_num_threads(threads)
        seconds = timed(lambda: one_pass(gemm, layers, xs), args.reps)
        read = timed(lambda: [f.sum() for f in floats], args.reps)
        print(
            f"threads {threads}: {len(layers)} calls {seconds * 1000:.2f} ms, "
            f"{total / 1e6:.1f} MB, {total / seconds / 1e9:.1f} GB/s "
            f"(torch.sum over as many bytes: {total / read / 1e9:.1f} GB/s)"
        )
        for packed, n, k in layers[: len(SHAPES)]:
            alone = timed(lambda p=packed, n=n, k=k: gemm(xs[k], p, n, None), 500)
            print(
                f"  {n}x{k} in cache: {alone * 1e6:.1f} us "
                f"({packed.numel() / alone / 1e9:.1f} GB/s)"
            )


if __name__ == "__main__":
    raise SystemExit(main())

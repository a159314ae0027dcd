"""Compute bound of this machine for a model: GEMM TFLOP/s at the model's own shapes.

For every Linear of the model (fused qkv, o, gate_up, down, lm_head) we time `F.linear` on
[M, in] x [out, in] with the weight in bfloat16 and in float32, and report the achieved
TFLOP/s over the whole set (total FLOPs / total time, so big matrices weigh more). The
decode throughput bound of an engine is then `TFLOP/s / (2 * matmul params)` tokens/s:
every generated token costs at least 2 FLOPs per weight it multiplies (attention over the
context is extra and not counted).

    .venv/bin/python -m loadtest.matmul_bound [--batch 64] [--threads N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

SMOLLM2_SHAPES = {  # (in_features, out_features, count) per SmolLM2-135M forward
    "qkv_proj": (576, 832, 30),
    "o_proj": (576, 576, 30),
    "gate_up_proj": (576, 3072, 30),
    "down_proj": (1536, 576, 30),
    "lm_head": (576, 49152, 1),
}


@dataclass
class GemmResult:
    dtype: str
    batch: int
    tflops: float
    seconds_per_forward: float
    matmul_params: int

    @property
    def bound_tokens_per_s(self) -> float:
        """Tokens/s if every token only paid 2 FLOPs per matmul weight at this rate."""
        return self.tflops * 1e12 / (2 * self.matmul_params)


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """(in, out, count) per distinct Linear name suffix of `model` (lm_head counted once)."""
    shapes: dict[str, tuple[int, int, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            key = name.rsplit(".", 1)[-1]
            in_f, out_f = module.in_features, module.out_features
            count = shapes.get(key, (in_f, out_f, 0))[2] + 1
            shapes[key] = (in_f, out_f, count)
    return shapes


def measure(
    shapes: dict[str, tuple[int, int, int]],
    dtype: torch.dtype,
    batch: int,
    repeats: int = 5,
    device: str | torch.device = "cpu",
) -> GemmResult:
    """Best-of-`repeats` time of one forward's worth of GEMMs at `batch` rows."""
    torch.manual_seed(0)
    cases = []
    for in_f, out_f, count in shapes.values():
        x = torch.randn(batch, in_f, dtype=dtype, device=device)
        w = torch.randn(out_f, in_f, dtype=dtype, device=device)
        cases.append((x, w, count))
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None
    for x, w, _ in cases:  # warm-up: kernel selection and caches
        F.linear(x, w)
    sync()
    total = 0.0
    for x, w, count in cases:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            F.linear(x, w)
            sync()
            best = min(best, time.perf_counter() - started)
        total += best * count
    flops = sum(2 * batch * i * o * c for i, o, c in shapes.values())
    params = sum(i * o * c for i, o, c in shapes.values())
    return GemmResult(str(dtype).removeprefix("torch."), batch, flops / total / 1e12, total, params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"load average {os.getloadavg()}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}"
    )
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch in args.batch:
            r = measure(SMOLLM2_SHAPES, dtype, batch)
            results.append(r)
            print(
                f"{r.dtype:9} M={batch:5}: {r.tflops:.3f} TFLOP/s, one forward's GEMMs "
                f"{r.seconds_per_forward * 1e3:.1f} ms -> bound {r.bound_tokens_per_s:,.0f} "
                f"tokens/s ({r.matmul_params / 1e6:.1f} M matmul params)"
            )
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(
                [asdict(r) | {"bound_tokens_per_s": r.bound_tokens_per_s} for r in results],
                handle,
                indent=2,
            )


if __name__ == "__main__":
    main()

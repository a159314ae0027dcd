"""Compiled vs eager forward in one process, alternating: a before/after that load drift
cannot bias (both sides share the same weights, kernels, KV cache and minutes).

    .venv/bin/python -m loadtest.compile_ab [--rounds 4] [--batch 1 16] [--context 128]
        [--steps 12] [--linear-kernel auto] [--dtype auto]

The engine is built with `compile="on"`; each round times `--steps` decode steps per batch
size with the compiled layers, then with `torch.compiler.set_stance("force_eager")` (the
same modules, run eagerly). Prints per-round medians and the median ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from loadtest.profile_step import measure
from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine


def _eager(model: torch.nn.Module):
    def forward(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        with torch.compiler.set_stance("force_eager"):
            return model(input_ids, positions)

    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--linear-kernel", default="auto")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model=DEFAULT_MODEL_NAME,
            dtype=args.dtype,
            device="cpu",
            compile="on",
            linear_kernel=args.linear_kernel,
            kv_cache_size_mb=256,
        )
    )
    runner = engine.executor.runner
    sides = {"compiled": runner.compiled, "eager": _eager(runner.model)}
    print(f"start {time.perf_counter() - started:.1f} s, load {os.getloadavg()}")
    print(f"kernels {engine.executor.kernels}")
    steps: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for name, forward in sides.items():
            runner.forward = forward
            for batch in args.batch:
                ms = measure(engine, batch, args.context, args.steps)["step_ms"]
                steps.setdefault((name, batch), []).append(ms)
                print(f"round {round_index} {name:8s} B={batch:3d}: step {ms:.1f} ms", flush=True)
    for batch in args.batch:
        compiled = statistics.median(steps[("compiled", batch)])
        eager = statistics.median(steps[("eager", batch)])
        ratio = eager / compiled
        print(f"B={batch}: compiled {compiled:.1f} ms, eager {eager:.1f} ms: {ratio:.2f}x")
    print(f"load after {os.getloadavg()}")


if __name__ == "__main__":
    main()

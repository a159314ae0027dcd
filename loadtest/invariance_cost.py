"""What batch invariance costs, in process: the same model as two engines, batch-invariant
kernels (`LLM_DETERMINISTIC=true`, the default) and the fastest kernel per batch size
(`false`), their decode steps and prefills timed in alternation so that both see the same
load.

    .venv/bin/python -m loadtest.invariance_cost [--batch 1 16] [--rounds 5] [--steps 20]
        [--context 128] [--prefill 2048] [--quantization none|int4]

Each round runs `steps` decode steps of B sequences on one engine, then on the other (and,
with `--prefill`, one prompt of that many tokens on each); the figures are the medians over
rounds of each engine's median step, and their ratio (invariant / fastest).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from loadtest.profile_step import measure
from shared.config import apply_openmp_defaults
from shared.model_files import DEFAULT_MODEL_NAME


def build(deterministic: bool, args: argparse.Namespace):
    from worker.engine.config import EngineConfig
    from worker.engine.engine import LLMEngine

    config = EngineConfig(
        model=args.model,
        dtype="auto",
        device="cpu",
        kv_cache_size_mb=1024,
        max_num_seqs=max(64, *args.batch),
        max_num_batched_tokens=max(2048, args.prefill),
        quantization=args.quantization,
        deterministic=deterministic,
    )
    engine = LLMEngine(config)
    print(f"deterministic={engine.executor.deterministic}: kernels {engine.executor.kernels}")
    return engine


def prefill_ms(engine, tokens: int) -> float:
    """One prompt of `tokens` random ids, prefilled (and one token decoded)."""
    return measure(engine, 1, tokens, 1)["prefill_ms"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill", type=int, default=0, help="also time a prompt this long")
    p.add_argument("--quantization", default="none")
    args = p.parse_args()
    apply_openmp_defaults()
    engines = {"invariant": build(True, args), "fastest": build(False, args)}
    print(f"load before: {os.getloadavg()}")
    rows = []
    for batch in args.batch:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(measure(engine, batch, args.context, args.steps)["step_ms"])
        rows.append((f"decode B={batch}", times))
    if args.prefill:
        times = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, engine in engines.items():
                times[name].append(prefill_ms(engine, args.prefill))
        rows.append((f"prefill {args.prefill}", times))
    print(f"load after: {os.getloadavg()} ({time.strftime('%H:%M:%S')})")
    print("| step | invariant ms | fastest ms | invariant / fastest time |\n|---|---:|---:|---:|")
    for label, times in rows:
        a, b = (statistics.median(times[n]) for n in ("invariant", "fastest"))
        print(f"| {label} | {a:.1f} | {b:.1f} | {a / b:.3f} |")


if __name__ == "__main__":
    main()

"""Ladle's service under two or more environments, alternating, on the grid's workloads.

    python -m loadtest.serve_ab --variant chooser= --variant fixed2=LLM_DECODE_THREADS=2 \
        --levels 16,64 --rounds 3 --shape chat

Each round starts one service per variant (`ladle up`, 1 worker, private Redis, the order
reversed every other round so neither side always runs first), warms it with 5 s at 4
clients, then runs each level for `--max-seconds`, and prints tok/s with the median ITL and
TTFT; at the end, each variant's tok/s per level and their mean. A variant is NAME=ENV, ENV
`;`-separated KEY=VALUE pairs (empty: the defaults); MODEL=... picks its model (default:
the default model's converted bf16 directory, as the grid's `ladle` column). Every loop is
bounded: rounds x variants x levels cells of at most `--max-seconds` each.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from loadtest.bench_serve import bench_http, default_hf_dir, running_service
from loadtest.grid import SHAPES, run_cells, workload_for
from loadtest.workload import LevelResult


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """'NAME=K=V;K2=V2' -> (NAME, {K: V, K2: V2}); 'NAME=' -> (NAME, {})."""
    name, sep, spec = text.partition("=")
    if not name or not sep:
        raise argparse.ArgumentTypeError(f"a variant is NAME=ENV, got {text!r}")
    env = {}
    for pair in filter(None, spec.split(";")):
        key, eq, value = pair.partition("=")
        if not key or not eq:
            raise argparse.ArgumentTypeError(f"{pair!r} in {text!r} is not KEY=VALUE")
        env[key] = value
    return name, env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--levels", default="16,64", help="client counts, comma-separated")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shape", choices=sorted(SHAPES), default="chat")
    p.add_argument("--max-seconds", type=float, default=15.0, help="per level")
    p.add_argument("--kv-mb", type=int, default=2048, help="LLM_KV_CACHE_SIZE_MB (the grid's)")
    p.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids below this")
    args = p.parse_args(argv)
    names = [name for name, _ in args.variant]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error("give two or more --variant, each with its own name")
    args.levels = [int(level) for level in args.levels.split(",")]
    return args


def one_service(args: argparse.Namespace, env: dict[str, str]) -> list[LevelResult]:
    """One service with `env` added: warmed, then each level once."""
    env = {"LLM_KV_CACHE_SIZE_MB": str(args.kv_mb), **env}
    model = env.pop("MODEL", str(default_hf_dir()))
    with running_service(1, model=model, extra_env=env) as url:
        warm = workload_for(args.shape, 4, args.vocab_size, seed=1)  # none of the levels' prompts
        asyncio.run(bench_http(url, None, warm, [4], 5.0))
        return run_cells(url, [args.shape], args.levels, args)[args.shape]


def run(args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    variants = dict(args.variant)
    results: dict[str, dict[int, list[float]]] = {n: {c: [] for c in args.levels} for n in variants}
    for r in range(args.rounds):
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            for cell in one_service(args, variants[name]):
                results[name][cell.concurrency].append(cell.output_tokens_per_s)
                print(
                    f"round {r} {name} c={cell.concurrency}: {cell.output_tokens_per_s:.1f} "
                    f"tok/s, median ITL {cell.itl_ms.median:.1f} ms, "
                    f"TTFT {cell.ttft_ms.median:.0f} ms",
                    flush=True,
                )
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name, levels in run(args).items():
        for level, values in levels.items():
            runs = " / ".join(f"{v:.1f}" for v in values)
            print(f"{name} c={level}: {runs} (mean {statistics.mean(values):.1f}) tok/s")


if __name__ == "__main__":
    main()

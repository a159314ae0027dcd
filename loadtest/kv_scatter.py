"""Decode attention over a served pool's block order: a sequence's blocks in order, in
descending runs (how a freed sequence's blocks come back off the free list), as a service
lays them out (`served`: the prompt's 8 blocks in order, then one block per sequence in turn,
as sequences that decode in step take their next blocks off the free list) or scattered.

    .venv/bin/python -m loadtest.kv_scatter [--context 256 1024] [--rows 1 16 64]
        [--threads 2] [--rounds 40] [--keys packed|tiles]

Thirty layers of SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64, blocks of
16), each layer its own 2 GiB-sized pool of packed bf16 keys and values (float32 where the
CPU lacks the bf16 kernels), so a step reads its caches from memory as the engine's does.
Each row gets fresh blocks per call. Pools come from `kv_cache.zeroed` (2 MiB pages where the
kernel offers them, as the engine allocates) and from `torch.zeros` (4 KiB pages). Reported:
the median ms of one step's 30 layers per order and pool, rounds alternating.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from loadtest.attention_rows import BLOCK, HEAD_DIM, HEADS, KV_HEADS, dtype, require_layouts
from worker.engine.kv_cache import zeroed
from worker.layers import native

LAYERS = 30
ORDERS = ("ordered", "descending", "served", "scattered")
PROMPT_BLOCKS = 8  # the grid's 128-token prompts


def block_rows(order: str, rows: int, blocks: int, pool: int, rng: random.Random) -> list:
    if order == "served" and rows * blocks > pool:
        raise SystemExit(f"served: {rows} x {blocks} blocks do not fit a {pool}-block pool")
    tables = []
    for _ in range(rows):
        start = rng.randrange(pool - blocks)
        if order == "ordered":
            tables.append(list(range(start, start + blocks)))
        elif order == "descending":
            tables.append(list(range(start + blocks - 1, start - 1, -1)))
        elif order == "served":
            row, prompt = len(tables), min(PROMPT_BLOCKS, blocks)
            first = row * prompt  # prompts side by side, then the decode blocks dealt in turn
            decode = [rows * prompt + j * rows + row for j in range(blocks - prompt)]
            tables.append(list(range(first, first + prompt)) + decode)
        else:
            tables.append(rng.sample(range(pool), blocks))
    return tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--pool-gib", type=float, default=2.0)
    parser.add_argument(
        "--keys",
        choices=["packed", "tiles"],
        default="packed",
        help="the vector kernel over packed keys, or the AMX tiles (packed keys and values)",
    )
    args = parser.parse_args()
    native.load()
    torch.set_num_threads(args.threads)
    kind = dtype()
    layer_bytes = 2 * KV_HEADS * BLOCK * HEAD_DIM * kind.itemsize
    pool = int(args.pool_gib * 2**30) // (LAYERS * layer_bytes)
    shape = (2, KV_HEADS, pool, BLOCK, HEAD_DIM)
    pools = {
        "2 MiB pages": [zeroed(shape, kind, torch.device("cpu")) for _ in range(LAYERS)],
        "4 KiB pages": [torch.zeros(shape, dtype=kind) for _ in range(LAYERS)],
    }
    for layers in pools.values():
        for cache in layers:
            cache.normal_()  # random bits either way: the layout only moves bytes around
    require_layouts([args.keys])
    tiles = args.keys == "tiles"
    print(f"{kind}, {pool} blocks a layer, {args.threads} threads, keys {args.keys}")
    rng = random.Random(0)
    for context in args.context:
        for rows in args.rows:
            q = torch.randn(rows, HEADS, HEAD_DIM).to(kind)
            lens = torch.full((rows,), context, dtype=torch.int64)
            times = {(o, p): [] for o in ORDERS for p in pools}
            for _ in range(args.rounds):
                for order, name in times:
                    tables = block_rows(order, rows, context // BLOCK, pool, rng)
                    table = torch.tensor(tables, dtype=torch.int64)
                    started = time.perf_counter()
                    for cache in pools[name]:
                        native.attention_rows(
                            q,
                            cache[0],
                            cache[1],
                            table,
                            lens,
                            HEAD_DIM**-0.5,
                            packed_keys=True,
                            tiles=tiles,
                        )
                    times[order, name].append(1000 * (time.perf_counter() - started))
            for name in pools:
                cells = "  ".join(f"{o} {statistics.median(times[o, name]):.3f}" for o in ORDERS)
                print(f"context {context:5d} rows {rows:3d} {name}: {cells} ms")


if __name__ == "__main__":
    main()

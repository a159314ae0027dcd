"""The native row attention against torch's SDPA, in process: a prefill's tokens attended as
rows (the batch-invariant way) and decode rows of many sequences.

    .venv/bin/python -m loadtest.attention_rows [--prefill 256 1024 2048] [--threads 1 2]
        [--decode 1 16 64] [--context 256] [--keys plain packed]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64, blocks of 16); bf16 where
the CPU has the bf16 kernels, else float32 (what the engine serves there). A
prefill of L tokens is L rows over one block table with context lengths 1..L, against SDPA's
causal attention over the same keys (flash attention on CPU); decode is B rows of B sequences
of ~`context` cached tokens. `--keys`: the key cache plain, packed as the engine's row
attention keeps it (`native.pack_keys`), or `tiles`: keys and values packed and attended on
the AMX tiles (`tiles=True`, where the CPU has them). Best of 5 runs each, with the largest
difference from SDPA's output.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from worker.layers import native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def dtype() -> torch.dtype:
    return torch.bfloat16 if native.bf16() else torch.float32


def best_ms(fn: Callable[[], object], runs: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def layout(k_cache: torch.Tensor, v_cache: torch.Tensor, keys: str) -> dict:
    """The caches as `keys` lays them out, and the matching `attention_rows` arguments."""
    if keys == "plain":
        return {"k_cache": k_cache, "v_cache": v_cache}
    packed = {"k_cache": native.pack_keys(k_cache), "v_cache": v_cache, "packed_keys": True}
    if keys == "tiles":
        packed.update(v_cache=native.pack_values(v_cache), tiles=True)
    return packed


def require_layouts(keys: list[str]) -> None:
    """Exit with the reason where a `--keys` layout cannot run on this CPU."""
    if "tiles" in keys and not native.attention_tiles_usable():
        raise SystemExit("--keys tiles: no AMX tiles (or no bf16 kernels) on this CPU")


def prefill(length: int, keys: str) -> tuple[float, float, float]:
    """(rows ms, SDPA ms, max |difference|) for one prompt of `length` tokens."""
    num_blocks = -(-length // BLOCK)
    k_cache = torch.randn(KV_HEADS, num_blocks + 4, BLOCK, HEAD_DIM).to(dtype())
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks + 4)[:num_blocks]
    tables = order.expand(length, num_blocks).contiguous()
    lens = torch.arange(1, length + 1)
    q = torch.randn(length, HEADS, HEAD_DIM).to(dtype())
    scale = HEAD_DIM**-0.5
    k = k_cache[:, order].reshape(KV_HEADS, -1, HEAD_DIM)[None, :, :length]
    v = v_cache[:, order].reshape(KV_HEADS, -1, HEAD_DIM)[None, :, :length]

    cache = layout(k_cache, v_cache, keys)

    def rows() -> torch.Tensor:
        return native.attention_rows(q, tables=tables, context_lens=lens, scale=scale, **cache)

    def sdpa() -> torch.Tensor:
        qq = q.transpose(0, 1)[None]
        return F.scaled_dot_product_attention(
            qq, k, v, is_causal=True, scale=scale, enable_gqa=True
        )

    error = (sdpa()[0].transpose(0, 1).float() - rows().float()).abs().max().item()
    return best_ms(rows), best_ms(sdpa), error


def decode(batch: int, keys: str, context: int = 256) -> float:
    num_blocks = -(-context // BLOCK)
    k_cache = torch.randn(KV_HEADS, batch * num_blocks, BLOCK, HEAD_DIM).to(dtype())
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * num_blocks).view(batch, num_blocks)
    lens = context - torch.arange(batch)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype())
    cache = layout(k_cache, v_cache, keys)
    return best_ms(
        lambda: native.attention_rows(q, tables=tables, context_lens=lens, scale=0.125, **cache),
        20,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", type=int, nargs="+", default=[256, 1024, 2048])
    p.add_argument("--decode", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    p.add_argument("--context", type=int, default=256, help="cached tokens per decode row")
    p.add_argument(
        "--keys", nargs="+", choices=["plain", "packed", "tiles"], default=["plain", "packed"]
    )
    args = p.parse_args(argv)
    if not native.load(None):
        raise SystemExit(f"native kernels unavailable: {native.status()}")
    require_layouts(args.keys)
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print("| threads | keys | case | rows ms | SDPA ms | rows / SDPA | max abs diff |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for keys in args.keys:
            for length in args.prefill:
                rows, sdpa, error = prefill(length, keys)
                print(
                    f"| {threads} | {keys} | prefill {length} | {rows:.2f} | {sdpa:.2f} "
                    f"| {rows / sdpa:.2f} | {error:.3g} |"
                )
            for batch in args.decode:
                ms = decode(batch, keys, args.context)
                case = f"decode B={batch}, {args.context} cached"
                print(f"| {threads} | {keys} | {case} | {ms:.3f} | | | |")


if __name__ == "__main__":
    main()

"""KV bytes one long sequence holds, with sliding-window layers sharing the full pool (before)
and on a pool of their own whose slid-out blocks are released (after).

    .venv/bin/python -m loadtest.kv_bytes [--tokens 8192] [--chunk 2048] [--block-size 16]

Gemma 3 270M's shape (18 layers, 5 local : 1 global, window 512, 1 KV head of 256, bf16):
the sequence is prefilled in chunks of `--chunk` tokens and then decoded one token at a time
up to `--tokens` through `HybridBlockManager`'s own bookkeeping; the blocks it holds in each
pool at the end (and at the peak) times each pool's bytes per block.
"""

from __future__ import annotations

import argparse

from worker.engine.core.block_manager import cdiv
from worker.engine.core.hybrid_blocks import HybridBlockManager
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams

# Gemma 3 270M (google/gemma-3-270m config.json)
LAYERS, GLOBAL_LAYERS, WINDOW, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 18, 3, 512, 1, 256, 2


def held_blocks(tokens: int, chunk: int, block_size: int) -> tuple[int, int, int]:
    """(full pool blocks, local blocks at the end, local blocks at the peak)."""
    num_blocks = cdiv(tokens, block_size) + 1
    hbm = HybridBlockManager(num_blocks, num_blocks, block_size, WINDOW)
    prompt = tokens // 2
    request = Request("r", list(range(prompt)), SamplingParams(temperature=0.0), tokens)
    hbm.allocate_prefix(request)
    peak = 0
    while request.num_computed_tokens < tokens:
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token(7)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert hbm.allocate_slots(request, num_new)
        peak = max(peak, hbm.local.num_used_blocks)
        request.num_computed_tokens += num_new
        hbm.cache_full_blocks(request, request.num_computed_tokens)
    return hbm.full.num_used_blocks, hbm.local.num_used_blocks, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    layer_block = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES * args.block_size  # K and V
    full, local, peak = held_blocks(args.tokens, args.chunk, args.block_size)
    before = cdiv(args.tokens, args.block_size) * LAYERS * layer_block
    local_layers = LAYERS - GLOBAL_LAYERS
    after = full * GLOBAL_LAYERS * layer_block + local * local_layers * layer_block
    at_peak = full * GLOBAL_LAYERS * layer_block + peak * local_layers * layer_block
    print(f"{args.tokens}-token sequence, Gemma 3 270M shape, bf16, block {args.block_size}:")
    print(f"  one pool (before): {before / 2**20:.1f} MiB ({LAYERS} layers x {full} blocks)")
    print(
        f"  two pools (after): {after / 2**20:.1f} MiB at the end ({GLOBAL_LAYERS} global "
        f"layers x {full} blocks + {local_layers} local x {local}); "
        f"{at_peak / 2**20:.1f} MiB at the peak (a {args.chunk}-token prefill chunk: {peak})"
    )


if __name__ == "__main__":
    main()

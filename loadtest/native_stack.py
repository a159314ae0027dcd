"""The decoder's layers as one native call against the Python layer loop, in one process.

    .venv/bin/python -m loadtest.native_stack [--batch 1 16 64] [--rounds 3] [--steps 30]
        [--quantization none|int4] [--decode-threads 2]

One engine on the default model (or `--model`); for each batch size, rounds alternate the
stack (`worker/models/native_stack.py`) and the loop it replaces, each round B requests of
`--context` random tokens decoded for `--steps` steps (`loadtest.profile_step.measure`).
Before timing, greedy tokens of 4 prompts must be identical both ways (the stack runs the
same ops in the same order). Prints the median step per variant and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from loadtest.profile_step import measure
from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine
from worker.models import native_stack


def set_stack(engine: LLMEngine, enabled: bool) -> None:
    """Use the native stack from the next step on, or the Python loop."""
    model = engine.executor.runner.model.model
    model.native_layers._built_at = -1  # rebuilt (or not) at the next step
    native_stack.build_stack = _BUILD if enabled else (lambda layers: None)


_BUILD = native_stack.build_stack


def greedy(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.prepare(f"g{i}", prompt, params))
    done: dict[str, list[int]] = {f"g{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for output in engine.step():
            done[output.request_id] += output.new_token_ids
    return [done[f"g{i}"] for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--decode-threads", type=int, default=None)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            device="cpu",
            kv_cache_size_mb=1024,
            decode_threads=args.decode_threads,
            max_num_seqs=max(64, *args.batch),
            max_num_batched_tokens=max(1024, args.context),
            quantization=args.quantization,
        )
    )
    print(f"{args.model} quantization={args.quantization} threads={torch.get_num_threads()}")
    prompts = [[1 + (7 * i + j) % 1000 for j in range(20 + 9 * i)] for i in range(4)]
    outputs = {}
    for enabled in (False, True):
        set_stack(engine, enabled)
        outputs[enabled] = greedy(engine, prompts, 24)
    same = outputs[True] == outputs[False]
    print(f"greedy tokens identical with and without the stack: {same}")
    if not same:
        raise SystemExit(1)
    for batch in args.batch:
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for enabled in (False, True):
                set_stack(engine, enabled)
                times[enabled].append(measure(engine, batch, args.context, args.steps)["step_ms"])
        loop, stack = statistics.median(times[False]), statistics.median(times[True])
        print(
            f"B={batch:3d}: step loop {loop:.1f} ms, stack {stack:.1f} ms, "
            f"stack/loop {stack / loop:.2f} (load {os.getloadavg()[0]:.1f})",
            flush=True,
        )


if __name__ == "__main__":
    main()

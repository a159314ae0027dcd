"""4-bit decode from a GGUF against the same weights quantized at load, in one process.

    .venv/bin/python -m loadtest.gguf_speed [--model GGUF] [--quantization int4|auto]
        [--rounds 3] [--steps 32] [--json OUT]

Two engines on the same file: "gguf" loads its own blocks (`--quantization`), "at load" its
converted HF directory (the file's float32 values, as `make run` caches them) quantized to
int4 at load, as a safetensors checkpoint would be. Each decodes one sequence greedily,
`--steps` tokens after a 128-token prompt, on one decode thread, in alternating rounds.
Decode time is generate(1 + steps) minus generate(1) (prefix caching off). Reported per
engine, best round: tokens/s by wall clock and by the main thread's CPU time (the decode runs
on it; other load on the machine barely moves CPU time, it moves wall time), and the load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from shared.model_files import DEFAULT_MODEL_NAME, converted_dir, resolve_model
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM
from worker.models.loader import hf_dir_for


def build(model: str, quantization: str) -> LLM:
    return LLM(
        EngineConfig(
            model=model,
            dtype="bfloat16",
            quantization=quantization,
            device="cpu",
            decode_threads=1,
            compile="off",
            linear_kernel="native",
            kv_cache_size_mb=256,
            enable_prefix_caching=False,
        )
    )


def _timed(llm: LLM, prompt: list[int], tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    wall, cpu = time.perf_counter(), time.thread_time()
    llm.generate([prompt], params)
    return time.perf_counter() - wall, time.thread_time() - cpu


def decode_rates(llm: LLM, prompt: list[int], steps: int) -> dict[str, float]:
    """tokens/s of `steps` decode steps, by wall clock and by this thread's CPU time."""
    first_wall, first_cpu = _timed(llm, prompt, 1)
    wall, cpu = _timed(llm, prompt, 1 + steps)
    return {"wall_tok_s": steps / (wall - first_wall), "cpu_tok_s": steps / (cpu - first_cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="a .gguf file")
    parser.add_argument("--quantization", default="int4", choices=["int4", "auto"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    source = resolve_model(args.model)
    assert source.kind == "gguf", "--model must be a GGUF file"
    hf_dir_for(args.model)  # converted once, as `make run` does
    engines = {
        "gguf": build(args.model, args.quantization),
        "at load": build(str(converted_dir(source)), "int4"),
    }
    prompt = [random.Random(0).randrange(10, 1000) for _ in range(128)]
    for llm in engines.values():  # warm-up: first calls pay one-time costs
        _timed(llm, prompt, 2)
    best: dict[str, dict[str, float]] = {}
    for round_index in range(args.rounds):
        for name, llm in engines.items():
            rates = decode_rates(llm, prompt, args.steps) | {"load": os.getloadavg()[0]}
            print(f"round {round_index} {name}: {rates}", flush=True)
            if name not in best or rates["cpu_tok_s"] > best[name]["cpu_tok_s"]:
                best[name] = rates
    for name, llm in engines.items():
        print(f"{name}: weights {llm.engine.executor.loaded.quantization}, best {best[name]}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"model": args.model, "steps": args.steps, "best": best}, handle, indent=2)


if __name__ == "__main__":
    main()

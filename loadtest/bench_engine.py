"""Offline engine throughput vs transformers one request at a time, in the same run.

    .venv/bin/python -m loadtest.bench_engine [--dtype auto] [--num-prompts 64]
        [--input-len 128] [--output-len 128] [--hf-requests 4] [--json OUT]
        [--device cpu|cuda|auto] [--no-cuda-graphs] [--lm-head-quantization none|int8|auto]

Every prompt is `input_len` random token ids; every request generates exactly `output_len`
tokens (greedy, ignore_eos). Reported:

- engine: `LLM.generate` on the whole batch at once -> output tokens/s (wall clock, prefill
  included), and the engine's single-request decode tokens/s (one prompt alone);
- transformers: `generate()` one request at a time on the first `--hf-requests` prompts,
  tokens/s extrapolated to the whole set (each request costs the same: same lengths);
- the ratio engine / transformers, and the engine's share of the GEMM compute bound measured
  in this run (loadtest/matmul_bound.py: bf16 or fp32 TFLOP/s at the model's shapes, M=64).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import Any

import torch

from loadtest.matmul_bound import measure, model_shapes
from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM
from worker.models.loader import hf_dir_for


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the low ids: SmolLM2's special tokens live there.
    return [[rng.randrange(100, vocab_size) for _ in range(length)] for _ in range(count)]


def bench_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == len(prompts) * output_len, f"generated {tokens} tokens"
    first = max(r.first_token_time for r in results) - started
    return {
        "seconds": elapsed,
        "output_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "last_first_token_s": first,
    }


def bench_single(llm: LLM, prompt: list[int], output_len: int) -> float:
    """Decode tokens/s of one request alone (time after its first token)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    result = llm.generate([prompt], params)[0]
    return (output_len - 1) / (result.finished_time - result.first_token_time)


def bench_transformers(
    model_dir: str,
    prompts: list[list[int]],
    output_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None  # generate exactly output_len tokens
    model.generation_config.pad_token_id = 0
    warm = torch.tensor([prompts[0][:8]], device=device)
    model.generate(warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False)
    started = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
        )
        assert out.shape[1] - ids.shape[1] == output_len
    elapsed = time.perf_counter() - started
    return {
        "requests": len(prompts),
        "seconds": elapsed,
        "tokens_per_s": len(prompts) * output_len / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="auto", help="auto (bf16 where native), float32...")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--hf-requests",
        type=int,
        default=4,
        help="transformers requests timed (0 to skip); tokens/s extrapolated",
    )
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--lm-head-quantization", default="none", choices=["none", "int8", "auto"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda", "auto"])
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="CUDA: run decode steps eagerly"
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_size_mb=args.kv_cache_mb,
        num_threads=args.threads,
        max_num_seqs=max(64, args.num_prompts),
        cuda_graphs=not args.no_cuda_graphs,
        lm_head_quantization=args.lm_head_quantization,
    )
    llm = LLM(config)
    executor = llm.engine.executor
    model = executor.loaded.model
    dtype = executor.loaded.dtype
    device = executor.loaded.device
    vocab = executor.vocab_size
    report: dict[str, Any] = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "cuda_graphs": executor.runner.graphs is not None,
        "threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "load_average_before": os.getloadavg(),
    }
    print(
        f"{args.model} {report['dtype']} {report['device']} "
        f"cuda_graphs={report['cuda_graphs']} threads={report['threads']} "
        f"load={report['load_average_before']}"
    )
    warm = random_prompts(4, args.input_len, vocab, seed=1)
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))

    prompts = random_prompts(args.num_prompts, args.input_len, vocab, seed=0)
    engine = bench_engine(llm, prompts, args.output_len)
    single = bench_single(llm, random_prompts(1, args.input_len, vocab, seed=2)[0], args.output_len)
    report["engine"] = engine | {"single_request_decode_tokens_per_s": single}
    print(
        f"engine: {args.num_prompts} prompts x {args.input_len} in / {args.output_len} out "
        f"in {engine['seconds']:.1f} s -> {engine['tokens_per_s']:.1f} output tokens/s "
        f"(all first tokens after {engine['last_first_token_s']:.1f} s)"
    )
    print(f"engine single-request decode: {single:.1f} tokens/s")

    gemm = measure(model_shapes(model), dtype, batch=min(64, args.num_prompts), device=device)
    report["gemm"] = {
        "tflops": gemm.tflops,
        "matmul_params": gemm.matmul_params,
        "bound_tokens_per_s": gemm.bound_tokens_per_s,
        "engine_share_of_bound": engine["tokens_per_s"] / gemm.bound_tokens_per_s,
    }
    print(
        f"GEMM at the model's shapes, M={gemm.batch}, {gemm.dtype}: {gemm.tflops:.3f} TFLOP/s "
        f"-> bound {gemm.bound_tokens_per_s:.0f} tokens/s; engine at "
        f"{100 * report['gemm']['engine_share_of_bound']:.0f}% of it"
    )

    if args.hf_requests:
        hf = bench_transformers(
            str(hf_dir_for(args.model)), prompts[: args.hf_requests], args.output_len, dtype, device
        )
        ratio = engine["tokens_per_s"] / hf["tokens_per_s"]
        report["transformers"] = hf | {"extrapolated": args.hf_requests < args.num_prompts}
        report["ratio"] = ratio
        print(
            f"transformers generate() one at a time ({report['dtype']}): timed "
            f"{hf['requests']} of {args.num_prompts} requests in {hf['seconds']:.1f} s -> "
            f"{hf['tokens_per_s']:.1f} tokens/s (extrapolated: every request is the same size)"
        )
        print(f"ratio engine / transformers: {ratio:.1f}x")
    report["load_average_after"] = os.getloadavg()
    print(f"load average after: {report['load_average_after']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)


if __name__ == "__main__":
    main()

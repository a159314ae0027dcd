"""Per-step overhead of the engine: where one decode step's time goes.

    .venv/bin/python -m loadtest.profile_step [--dtype auto] [--threads N] [--batch 1 64]
        [--decode-threads N] [--context 128] [--steps 40] [--compile auto|on|off]
        [--linear-kernel auto|NAME]
        [--quantization none|int8|int4] [--native on|off] [--deterministic on|off]
        [--int4-kernel auto|avx512|vnni|amx] [--attention-kernel auto|avx512|amx] [--ops]
        [--cprofile] [--json OUT]

For each batch size B: B requests of `context` random token ids are prefilled, then the
engine decodes `steps` steps with all B running. Reported per step (medians):

- step: `LLMEngine.step()` wall time (what a client's inter-token latency is made of);
- forward: the model's forward + logits (`ModelRunner.compute_logits`);
- sample: the sampler; python: the rest (scheduler, metadata, update, detokenizer);
- prefill: the first step (B prompts of `context` tokens at once);
- at B = 1, the share of the memory-bandwidth bound measured in the same run
  (`loadtest/bandwidth_bound.py`: weight bytes per token / streamed GB/s).

`--int4-kernel` (`LLM_INT4_KERNEL`) overrides, for this run, which int4 kernel `native.load`
kept for the machine (`avx512`: `vdpbf16ps`; `vnni`: int8 x on `vpdpbusd`; `amx`: tile
sums), to time a step on each;
`--attention-kernel` (`LLM_ATTENTION_KERNEL`) likewise for bf16 attention (vectors or tiles).
`--ops` adds a torch.profiler table (top ops by self CPU time, op count per step);
`--cprofile` a cProfile of the Python outside the forward.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import time
from typing import Any

import torch

from loadtest.bandwidth_bound import stream_bandwidth, weight_bytes_per_token
from shared.config import Settings
from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.engine import LLMEngine


class _Timed:
    """Wraps a callable and records the wall time of each call."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # the process's CPU time: what other load moves least

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started, cpu_started = time.perf_counter(), time.process_time()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.times.append(time.perf_counter() - started)
            self.cpu_times.append(time.process_time() - cpu_started)


_RNG = random.Random(0)


def _add_requests(engine: LLMEngine, batch: int, context: int, max_tokens: int) -> None:
    """B new random prompts (never seen before: no prefix cache hits)."""
    rng = _RNG
    vocab = engine.executor.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, vocab) for _ in range(context)]
        engine.add_request(engine.prepare(f"b{batch}-{i}-{time.monotonic_ns()}", prompt, params))


def measure(engine: LLMEngine, batch: int, context: int, steps: int) -> dict[str, float]:
    """Prefill B prompts, then time `steps` decode steps; medians in milliseconds."""
    runner = engine.executor.runner
    forward, sample = _Timed(runner.compute_logits), _Timed(runner.sampler.sample)
    runner.compute_logits, runner.sampler.sample = forward, sample
    try:
        _add_requests(engine, batch, context, steps + 2)
        step_times = []
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - started)
    finally:
        del runner.compute_logits, runner.sampler.sample
    # Prefill may take several steps (token budget); decode steps have exactly B tokens.
    num_prefill = len(step_times) - (steps + 1)
    decode = slice(num_prefill, num_prefill + steps)
    step_ms = [1000 * t for t in step_times[decode]]
    fwd_ms = [1000 * t for t in forward.times[decode]]
    smp_ms = [1000 * t for t in sample.times[decode]]
    py_ms = [s - f - m for s, f, m in zip(step_ms, fwd_ms, smp_ms, strict=True)]
    return {
        "batch": batch,
        "prefill_ms": 1000 * sum(step_times[:num_prefill]),
        "step_ms": statistics.median(step_ms),
        "forward_ms": statistics.median(fwd_ms),
        "forward_cpu_ms": 1000 * statistics.median(forward.cpu_times[decode]),
        "sample_ms": statistics.median(smp_ms),
        "python_ms": statistics.median(py_ms),
        "decode_tokens_per_s": 1000 * batch / statistics.median(step_ms),
    }


def _prefill(engine: LLMEngine, batch: int, context: int, steps: int) -> None:
    """Add B requests and step until a step is a pure decode step of B tokens."""
    _add_requests(engine, batch, context, steps + 8)
    while True:
        engine.step()
        if engine.stats().last_num_batched_tokens == batch:
            return


def op_table(engine: LLMEngine, batch: int, context: int, steps: int = 5) -> str:
    """torch.profiler over `steps` decode steps of B sequences: top ops and ops per step."""
    from torch.profiler import ProfilerActivity, profile

    _prefill(engine, batch, context, steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.key_averages()
    num_ops = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    table = events.table(sort_by="self_cpu_time_total", row_limit=18)
    return f"B={batch}: {num_ops:.0f} aten ops per step (incl. nested)\n{table}"


def python_profile(engine: LLMEngine, batch: int, context: int, steps: int = 30) -> str:
    _prefill(engine, batch, context, steps)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    while engine.has_unfinished_requests():
        engine.step()
    stream_lines: list[str] = []

    class _Sink:
        def write(self, text: str) -> None:
            stream_lines.append(text)

    pstats.Stats(profiler, stream=_Sink()).sort_stats("tottime").print_stats(25)
    return "".join(stream_lines)


def _bound_share(engine: LLMEngine, tokens_per_s: float) -> dict[str, float]:
    """The decode rate as a share of weight bytes per token / stream bandwidth, now (on the
    decode step's own thread count)."""
    bandwidth = stream_bandwidth(threads=engine.executor.decode_threads_for(1))
    weight_bytes = weight_bytes_per_token(engine.executor.runner.model)
    bound = bandwidth / weight_bytes
    print(
        f"  memory bound: {weight_bytes / 1e6:.0f} MB per token at {bandwidth / 1e9:.1f} GB/s "
        f"-> {bound:.1f} tok/s; this run {tokens_per_s:.1f} = {100 * tokens_per_s / bound:.0f} %"
    )
    share = tokens_per_s / bound
    return {"weight_bytes": weight_bytes, "stream_bytes_per_s": bandwidth, "bound_share": share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--decode-threads", type=int, help="default: LLM_DECODE_THREADS, else measured"
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1, help="runs per batch size")
    parser.add_argument("--ops", action="store_true", help="torch.profiler op table")
    parser.add_argument("--cprofile", action="store_true", help="cProfile of the step")
    parser.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--linear-kernel", default="auto")
    parser.add_argument("--quantization", default="none")
    parser.add_argument(
        "--native", default="on", choices=["on", "off"], help="Ladle's native CPU kernels"
    )
    parser.add_argument(
        "--deterministic", default="on", choices=["on", "off"], help="batch-invariant kernels"
    )
    parser.add_argument("--lm-head-quantization", default="none", choices=["auto", "none", "int8"])
    parser.add_argument(
        "--int4-kernel",
        default="auto",
        choices=["auto", "avx512", "vnni", "amx"],
        help="LLM_INT4_KERNEL: int4 on vdpbf16ps, int8 x on vpdpbusd or AMX tiles (auto: the "
        "one timed fastest)",
    )
    parser.add_argument(
        "--attention-kernel",
        default="auto",
        choices=["auto", "avx512", "amx"],
        help="LLM_ATTENTION_KERNEL: bf16 attention on vectors or AMX tiles (auto: timed)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "model", "float16"],
        help="LLM_KV_CACHE_DTYPE: float16 halves what a float32 model's attention reads",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        kv_cache_size_mb=1024,
        num_threads=args.threads,
        decode_threads=args.decode_threads or Settings().decode_threads,
        max_num_seqs=max(64, *args.batch),
        max_num_batched_tokens=max(1024, args.context),
        compile=args.compile,
        linear_kernel=args.linear_kernel,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        int4_kernel=args.int4_kernel,
        attention_kernel=args.attention_kernel,
        kv_cache_dtype=args.kv_cache_dtype,
        native_kernels=args.native == "on",
        deterministic=args.deterministic == "on",
    )
    started = time.perf_counter()
    engine = LLMEngine(config)
    executor = engine.executor
    print(
        f"{args.model} {executor.dtype} threads={torch.get_num_threads()} "
        f"compiled={executor.compiled} deterministic={executor.deterministic} "
        f"start {time.perf_counter() - started:.1f} s "
        f"load={os.getloadavg()}\nkernels: {executor.kernels}"
    )
    measure(engine, 2, args.context, 4)  # warm-up
    results = []
    for batch in args.batch:
        for _ in range(args.repeat):
            result = measure(engine, batch, args.context, args.steps)
            results.append(result)
            print(
                f"B={batch:3d} ctx={args.context}: step {result['step_ms']:.1f} ms "
                f"(forward {result['forward_ms']:.1f}, sample {result['sample_ms']:.2f}, "
                f"python {result['python_ms']:.2f}) -> {result['decode_tokens_per_s']:.1f} "
                f"tok/s; prefill {result['prefill_ms']:.0f} ms"
            )
            if batch == 1:
                result |= _bound_share(engine, result["decode_tokens_per_s"])
        if args.ops:
            print(op_table(engine, batch, args.context))
        if args.cprofile:
            print(python_profile(engine, batch, args.context))
    print(f"load after: {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"load": os.getloadavg(), "results": results}, handle, indent=2)


if __name__ == "__main__":
    main()

"""`python -m worker.engine.cli`: run the offline engine on the default model (no Redis)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import fields
from typing import Any, get_args

from shared.config import Settings, apply_openmp_defaults
from worker.engine.config import EngineConfig
from worker.engine.core.sampling_params import SamplingParams


def _fields_from(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The flags named like a field of the dataclass `cls` (flags and fields share names)."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}


def _choices(name: str) -> tuple[str, ...]:
    """The values a Literal setting allows, as declared in `Settings`."""
    return get_args(Settings.model_fields[name].annotation)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m worker.engine.cli",
        description="Generate text with Ladle's engine in-process (no Redis, no API).",
    )
    parser.add_argument(
        "--model",
        default=EngineConfig.model,
        help="default model name, a local HF directory, or a .gguf file",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        default=[],
        help="prompt text (repeat for a batch); read from stdin if absent",
    )
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message and apply the chat template",
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--dtype", default=EngineConfig.dtype, choices=_choices("dtype"))
    parser.add_argument("--device", default=EngineConfig.device, choices=_choices("device"))
    parser.add_argument(
        "--quantization",
        default=EngineConfig.quantization,
        choices=_choices("quantization"),
        help="weight-only quantized projections (CPU)",
    )
    parser.add_argument("--kv-cache-size-mb", type=int, default=EngineConfig.kv_cache_size_mb)
    parser.add_argument(
        "--kv-cache-dtype",
        default=EngineConfig.kv_cache_dtype,
        choices=_choices("kv_cache_dtype"),
        help="float16: a float32 model's KV cache in half the bytes (auto: under quantization)",
    )
    parser.add_argument(
        "--speculative-ngram",
        type=int,
        default=EngineConfig.speculative_ngram,
        help="draft tokens per decode step from n-gram prompt lookup (0: off)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    apply_openmp_defaults()  # before torch loads (the engine imports it)
    from worker.engine.offline import LLM

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    prompts = args.prompt or [sys.stdin.read()]
    started = time.perf_counter()
    llm = LLM(EngineConfig(**_fields_from(args, EngineConfig)))
    load_s = time.perf_counter() - started
    params = SamplingParams(**_fields_from(args, SamplingParams))
    started = time.perf_counter()
    if args.chat:
        results = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        results = llm.generate(prompts, params)
    gen_s = time.perf_counter() - started
    num_tokens = 0
    for prompt, result in zip(prompts, results, strict=True):
        for output in result.outputs:
            print(f"--- {prompt!r} [{output.index}] ({output.finish_reason})")
            print(output.text)
        num_tokens += result.usage.completion_tokens
    print(
        f"--- load {load_s:.2f} s; {num_tokens} tokens in {gen_s:.2f} s "
        f"({num_tokens / max(gen_s, 1e-9):.1f} tokens/s)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

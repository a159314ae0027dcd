"""bf16 decode time per weight byte of each family, and a MoE step against transformers'.

    .venv/bin/python -m loadtest.family_step [--families llama gemma3 moe] [--batch 1 16]
        [--steps 20] [--rounds 3] [--context 128] [--threads 2] [--ops] [--clock C]
        [--workdir DIR] [--json OUT]

Random-weight models with the shapes of real ones (saved once under `--workdir`):
- llama: SmolLM2-135M (30 layers, hidden 576, vocab 49152);
- gemma3: Gemma 3 270M (18 layers, hidden 640, head_dim 256, 5 local : 1 global, vocab 262144);
- moe: OLMoE-1B-7B scaled down (6 layers, hidden 1024, 64 experts, top-8, expert size 512,
  vocab 50304).

All engines are built first; then, in rounds, each family's forward time per decode step
(`loadtest.profile_step.measure`, bf16, native kernels) at each batch size, and at B=1 the
milliseconds per MB of weights one token reads (a MoE counts its *active* experts: top_k of
num_experts), relative to Llama's. For the MoE, the same decode step through transformers'
eager model (its MoE loops over the hit experts) with a KV cache of the same context, and one
MoE block alone (ours: tokens grouped by expert, one matmul per active expert). Every family
decodes on `--threads` threads (pinned: the kernel plan does not choose). `--ops` adds each
family's torch.profiler table at the first batch size (`loadtest.profile_step --ops`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from loadtest.bandwidth_bound import weight_bytes_per_token
from loadtest.profile_step import measure, op_table
from worker.engine.config import EngineConfig
from worker.engine.engine import LLMEngine
from worker.layers.moe import SparseMoE


def family_configs() -> dict[str, Any]:
    import transformers

    common = dict(rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    llama = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
        max_position_embeddings=8192, **common,
    )  # fmt: skip
    gemma3 = transformers.Gemma3TextConfig(
        vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, **common,
    )  # fmt: skip
    moe = transformers.OlmoeConfig(
        vocab_size=50304, hidden_size=1024, intermediate_size=512, num_hidden_layers=6,
        num_attention_heads=8, num_key_value_heads=8, num_experts=64, num_experts_per_tok=8,
        max_position_embeddings=4096, **common,
    )  # fmt: skip
    for config, arch in ((llama, "Llama"), (gemma3, "Gemma3"), (moe, "Olmoe")):
        config.architectures = [f"{arch}ForCausalLM"]
    return {"llama": llama, "gemma3": gemma3, "moe": moe}


def model_dir(name: str, config: Any, workdir: Path) -> Path:
    """A bf16 random-weight checkpoint with a word-level tokenizer over its whole vocab."""
    import transformers

    from tests.support.engines import add_tiny_tokenizer

    path = workdir / name
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    add_tiny_tokenizer(path, vocab_size=config.vocab_size)
    return path


def active_bytes(model: torch.nn.Module) -> int:
    """Weight bytes one token reads: every linear once, but of each MoE only top_k experts."""
    total = weight_bytes_per_token(model)
    for module in model.modules():
        if isinstance(module, SparseMoE):
            experts = sum(p.numel() * p.element_size() for p in module.experts.parameters())
            total -= experts - experts * module.spec.top_k // module.spec.num_experts
    return total


def engine_for(path: Path, args: argparse.Namespace) -> LLMEngine:
    config = EngineConfig(
        model=str(path), dtype="bfloat16", device="cpu", kv_cache_size_mb=512,
        num_threads=args.threads, decode_threads=args.threads, compile="off",
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=max(1024, args.context), native_kernels=True,
    )  # fmt: skip
    return LLMEngine(config)


def rounds(engines: dict[str, LLMEngine], args: argparse.Namespace) -> dict[str, Any]:
    """Forward ms per family and batch, the families alternating round by round, so that a
    change of the machine's load falls on all of them alike; ratios are taken per round."""
    times: dict[str, dict[int, list[float]]] = {n: {b: [] for b in args.batch} for n in engines}
    for engine in engines.values():
        measure(engine, 2, args.context, 3)  # warm-up
    for _ in range(args.rounds):
        for name, engine in engines.items():
            for batch in args.batch:
                times[name][batch].append(
                    measure(engine, batch, args.context, args.steps)[args.clock]
                )
    results: dict[str, Any] = {}
    for name, engine in engines.items():
        model = engine.executor.runner.model
        result: dict[str, Any] = {"kernels": engine.executor.kernels, "bytes": active_bytes(model)}
        for batch in args.batch:
            result[f"forward_ms_b{batch}"] = statistics.median(times[name][batch])
            result[f"rounds_ms_b{batch}"] = times[name][batch]
        first = times[name][args.batch[0]]
        result["ms_per_mb"] = statistics.median(first) / (result["bytes"] / 1e6)
        results[name] = result
    if "llama" in engines:
        base = times["llama"][args.batch[0]]
        mb = {name: results[name]["bytes"] / 1e6 for name in engines}
        for name in engines:
            per_round = [
                t / mb[name] / (b / mb["llama"])
                for t, b in zip(times[name][args.batch[0]], base, strict=True)
            ]
            results[name]["vs_llama_per_round"] = per_round
            results[name]["vs_llama"] = statistics.median(per_round)
    return results


def _median_ms(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - started))
    return statistics.median(times)


@torch.inference_mode()
def transformers_step(path: Path, batch: int, args: argparse.Namespace) -> float:
    """transformers' eager model: prefill B x context with a cache, then median decode ms."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="sdpa", experts_implementation="eager"
    ).eval()
    ids = torch.randint(100, model.config.vocab_size, (batch, args.context))
    out = model(ids, use_cache=True)
    cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(args.steps):
        started = time.perf_counter()
        out = model(next_ids, past_key_values=cache, use_cache=True)
        times.append(1000 * (time.perf_counter() - started))
        cache, next_ids = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


@torch.inference_mode()
def moe_block(model: torch.nn.Module, path: Path, batch: int) -> dict[str, float]:
    """One MoE block on B tokens: ours against transformers' on the same first-layer weights."""
    import transformers

    ours_block = next(m for m in model.modules() if isinstance(m, SparseMoE))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, experts_implementation="eager"
    )
    hf_block = hf.model.layers[0].mlp
    x = torch.randn(batch, ours_block.gate.in_features, generator=torch.Generator().manual_seed(1))
    x = x.bfloat16()
    return {
        "ours_ms": _median_ms(lambda: ours_block(x), 30),
        "transformers_ms": _median_ms(lambda: hf_block(x[None]), 30),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=["llama", "gemma3", "moe"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per family")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ops", action="store_true", help="torch.profiler op table per family")
    parser.add_argument(
        "--clock",
        choices=["forward_ms", "forward_cpu_ms"],
        default="forward_ms",
        help="wall time, or the process's CPU time (steadier on a shared machine at --threads 1)",
    )
    parser.add_argument("--workdir", default="/tmp/ladle-family-step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    configs, report = family_configs(), {"load_before": os.getloadavg()}
    paths = {name: model_dir(name, configs[name], Path(args.workdir)) for name in args.families}
    engines = {name: engine_for(path, args) for name, path in paths.items()}
    report |= rounds(engines, args)
    for name, engine in engines.items():
        print(name, json.dumps(report[name]), flush=True)
        if args.ops:
            print(op_table(engine, args.batch[0], args.context), flush=True)
    if "moe" in engines:
        model = engines["moe"].executor.runner.model
        for batch in args.batch:
            report["moe"][f"transformers_step_ms_b{batch}"] = transformers_step(
                paths["moe"], batch, args
            )
            report["moe"][f"block_b{batch}"] = moe_block(model, paths["moe"], batch)
        print("moe vs transformers", json.dumps(report["moe"]), flush=True)
    for name in args.families:
        ratio = report[name].get("vs_llama")
        versus = f", {ratio:.2f}x llama's (median of per-round ratios)" if ratio else ""
        print(f"{name}: {report[name]['ms_per_mb']:.4f} ms/MB at B={args.batch[0]}{versus}")
    report["load_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

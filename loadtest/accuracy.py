"""Accuracy of bf16 and int8/int4 weights against float32, on our engine's model.

    .venv/bin/python -m loadtest.accuracy [--variants bfloat16,int8,int4] [--num-prompts 50]
        [--tokens 32] [--text loadtest/data/english.txt] [--window 512] [--json OUT]

1. float32 greedy-generates `--tokens` tokens for each prompt (the engine, ignore_eos).
2. Teacher forcing: every variant scores prompt + float32's continuation in one prefill; at
   every continuation position we compare its top-1 token with float32's. The share of
   positions where they agree is the headline (targets: bf16 and int8 >= 97%, int4 >= 90%).
3. Free running: each variant greedy-generates on its own; we report the share of prompts
   whose first 16 tokens equal float32's exactly.
4. Perplexity of every variant (float32 included) on a fixed English text kept in the repo,
   scored in consecutive windows of `--window` tokens (each window's first token unscored).

A variant is a dtype (`float32`, `bfloat16`) or a quantization (`int8`, `int4`, `auto`: a
GGUF's tensors as the file holds them; run with bf16 embeddings, norms and lm_head, the
default dtype on CPUs with native bf16; `int8/float32` keeps those in float32; a `+int8head`
suffix, e.g. `int4+int8head`, serves the lm_head in int8 as LLM_LM_HEAD_QUANTIZATION=int8;
`+kv16` keeps the KV cache in float16 and `+kvmodel` in the model's dtype, as
LLM_KV_CACHE_DTYPE=float16 / model; without either, its default, auto; `+avx512`, `+vnni` or
`+amx` names the int4 kernel as LLM_INT4_KERNEL does, else the one timed fastest here).
Prompts: the chat template over short varied user questions (real text, not random ids), or
the questions as plain text for a model without a chat template (a base model).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

import torch

from shared.model_files import DEFAULT_MODEL_NAME
from worker.engine.config import EngineConfig
from worker.engine.core.outputs import ScheduledChunk, SchedulerOutput
from worker.engine.core.request import Request
from worker.engine.core.sampling_params import SamplingParams
from worker.engine.offline import LLM

TOPICS = [
    "the moon",
    "bread",
    "rivers",
    "chess",
    "volcanoes",
    "honey bees",
    "the piano",
    "glaciers",
    "tea",
    "bicycles",
    "owls",
    "lighthouses",
    "maps",
    "soap",
    "thunder",
]
TEMPLATES = [
    "Tell me a fact about {}.",
    "Write one sentence about {}.",
    "Why do people like {}?",
    "Explain {} to a child.",
]
FREE_RUN_TOKENS = 16
DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "english.txt"
QUANTIZED = ("auto", "int8", "int4")


def questions(count: int) -> list[str]:
    items = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return items[:count]


# Suffixes naming the int4 kernel (LLM_INT4_KERNEL), e.g. `int4+avx512` against `int4+vnni`.
INT4_KERNELS = ("avx512", "vnni", "amx")


def build_llm(model: str, variant: str) -> LLM:
    """The offline engine for `variant`: a dtype, or a quantization over bf16 ("int8") or
    over another dtype for the rest of the model ("int8/float32"); "+int8head" serves the
    lm_head in int8 too (LLM_LM_HEAD_QUANTIZATION=int8); "+kv16" / "+kvmodel" set the KV
    cache's dtype; "+avx512" / "+vnni" / "+amx" the int4 kernel."""
    variant, *suffixes = variant.split("+")
    kv = {"kv16": "float16", "kvmodel": "model"}
    unknown = set(suffixes) - {"int8head", *kv, *INT4_KERNELS}
    if unknown:
        raise SystemExit(f"unknown variant suffix: {', '.join(sorted(unknown))}")
    kv_dtype = next((kv[s] for s in suffixes if s in kv), "auto")
    int4_kernel = next((s for s in suffixes if s in INT4_KERNELS), "auto")
    name, _, rest_dtype = variant.partition("/")
    quantized = name in QUANTIZED
    return LLM(
        EngineConfig(
            model=model,
            dtype=(rest_dtype or "bfloat16") if quantized else name,
            quantization=name if quantized else "none",
            device="cpu",
            kv_cache_size_mb=256,
            enable_prefix_caching=False,
            lm_head_quantization="int8" if "int8head" in suffixes else "none",
            kv_cache_dtype=kv_dtype,
            int4_kernel=int4_kernel,
        )
    )


def forced_logits(llm: LLM, tokens: list[int], first: int) -> torch.Tensor:
    """Float32 logits predicting tokens[first:], from one prefill of `tokens`.

    The prefill writes KV blocks 0.. behind the block manager's back: fine while the engine is
    idle and prefix caching is off (nothing can reuse those blocks' old contents).
    """
    from worker.engine.attention_metadata import build_step_inputs
    from worker.layers.context import set_attention_metadata

    runner = llm.engine.executor.runner
    blocks = list(range(-(-len(tokens) // runner.block_size)))
    request = Request("forced", tokens, SamplingParams(), max_tokens=1)
    step = SchedulerOutput([ScheduledChunk(request, 0, len(tokens), blocks, True)])
    with torch.inference_mode():
        inputs = build_step_inputs(
            step.chunks, runner.block_size, runner.device, runner.row_attention
        )
        set_attention_metadata(inputs.metadata)
        try:
            hidden = runner.model(inputs.input_ids, inputs.positions)
        finally:
            set_attention_metadata(None)
        return runner.model.compute_logits(hidden[first - 1 : -1])


def top1_agreement(llm: LLM, sequences: list[list[int]], starts: list[int], reference) -> tuple:
    """(agreeing positions, positions): top-1 after each continuation prefix vs `reference`."""
    agree = total = 0
    for tokens, start, expected in zip(sequences, starts, reference, strict=True):
        top1 = forced_logits(llm, tokens, start).argmax(dim=-1).tolist()
        agree += sum(a == b for a, b in zip(top1, expected, strict=True))
        total += len(top1)
    return agree, total


def perplexity(llm: LLM, tokens: list[int], window: int) -> float:
    """exp(mean NLL) over consecutive windows, each window's first token unscored."""
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        logits = forced_logits(llm, chunk, 1)
        targets = torch.tensor(chunk[1:])
        nll += torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item()
        count += len(chunk) - 1
    return math.exp(nll / count)


def answer(llm: LLM, prompts: list[str], params: SamplingParams) -> list:
    """Each question through the chat template, or as plain text for a model without one."""
    if getattr(llm.engine.tokenizer.hf, "chat_template", None):
        return llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return llm.generate(prompts, params)


def evaluate(args: argparse.Namespace) -> dict:
    reference_llm = build_llm(args.model, "float32")
    conversations = questions(args.num_prompts)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    reference = answer(reference_llm, conversations, greedy)
    sequences = [r.prompt_token_ids + r.outputs[0].token_ids for r in reference]
    starts = [len(r.prompt_token_ids) for r in reference]
    expected = [r.outputs[0].token_ids for r in reference]
    text_ids = reference_llm.engine.tokenizer.encode(Path(args.text).read_text())
    # float32's own teacher-forced top-1 is its greedy continuation (sanity check).
    agree, total = top1_agreement(reference_llm, sequences, starts, expected)
    assert agree == total, "float32 forced != float32 greedy"
    rows = {"float32": {"perplexity": perplexity(reference_llm, text_ids, args.window)}}
    del reference_llm
    for variant in args.variants.split(","):
        llm = build_llm(args.model, variant)
        agree, total = top1_agreement(llm, sequences, starts, expected)
        free = answer(llm, conversations, greedy)
        same = sum(
            f.outputs[0].token_ids[:FREE_RUN_TOKENS] == e[:FREE_RUN_TOKENS]
            for f, e in zip(free, expected, strict=True)
        )
        rows[variant] = {
            "top1_agreement": agree / total,
            "positions": total,
            "free_run_first16_exact_share": same / len(conversations),
            "perplexity": perplexity(llm, text_ids, args.window),
        }
        print(variant, rows[variant], flush=True)
    return {
        "prompts": len(conversations),
        "tokens": args.tokens,
        "text_tokens": len(text_ids),
        "window": args.window,
        "variants": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--variants", default="bfloat16,int8,int4")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--text", default=str(DEFAULT_TEXT))
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    load_before = os.getloadavg()
    report = evaluate(args)
    report["load_average_before_after"] = [load_before, os.getloadavg()]
    print(
        f"| variant | top-1 vs float32 | free-run first {FREE_RUN_TOKENS} identical | "
        f"perplexity ({report['text_tokens']} tokens) |"
    )
    print("|---|---|---|---|")
    for name, row in report["variants"].items():
        agreement = row.get("top1_agreement")
        share = row.get("free_run_first16_exact_share")
        print(
            f"| {name} | {'-' if agreement is None else f'{100 * agreement:.2f}%'} "
            f"| {'-' if share is None else f'{100 * share:.0f}%'} | {row['perplexity']:.3f} |"
        )
    print(f"load average before {load_before}, after {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

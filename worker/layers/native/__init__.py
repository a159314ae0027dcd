"""Ladle's own CPU kernels: C++ compiled on the machine at hand and loaded as torch ops.

`load(cache_dir)` compiles the sources (`SOURCES`: the bf16, int4, int8 and float32 matmuls, paged
attention, the small ops between matmuls) once with the system's g++ (`-march=native`, so the
code uses exactly the instructions this CPU has) against the running torch's headers, and
loads them with `torch.ops.load_library`; the ops then live under `torch.ops.ladle_native`.
Every op computes a row the same way whatever else is in the call (`gemm.h`).
The shared object is cached under `{cache}/native/`, keyed by the source, the CPU's model and
flags, torch's version and the compiler's, so a restart on the same machine loads it in
milliseconds (a first build takes ~20 s). `make install` builds it once more into the
environment (`python -m worker.prepare`, under `{sys.prefix}/share/ladle/native/`), where a
start with an empty cache finds it under the same name.

The bf16 kernels (bf16, int4 and int8 matmuls on bf16 activations, bf16 attention, the bf16
small ops) need AVX512-BF16 (`bf16()`); the float32 ones (matmul, int4 and int8 on float32
activations, attention, the small ops, the layer stack: all a float32 model needs) also build
for AVX2 with FMA (`vec16.h`: AMD Zen 2/3, older Intel).
Nothing depends on them: where there is no compiler, the build fails, or the CPU lacks the
instructions, `load` says why in one log line and returns False, and the kernels built on it
(`worker/layers/linear_kernels.py`) do not apply, so the autotuner never offers them.
`LLM_NATIVE_KERNELS=false` skips the build and uses none of them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shared.model_files import cache_root, installed_root

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = tuple(
    _HERE / name
    for name in (
        "gemm_bf16.cpp",
        "gemm_int4.cpp",
        "gemm_int8.cpp",
        "gemm_f32.cpp",
        "attention.cpp",
        "glue_bf16.cpp",
        "glue_f32.cpp",
        "stack.cpp",
    )
)
HEADERS = tuple(
    _HERE / name for name in ("vec_bf16.h", "vec16.h", "gemm.h", "gemm_q8.h", "glue.h", "amx.h")
)
BUILD_TIMEOUT_S = 600
_state: dict[str, object] = {}  # "loaded": bool, "reason": str (why not)


def cpu_identity() -> str:
    """ "model name [flags]" of this CPU: what a build or a timing made here is keyed by."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    fields = {k.strip(): v.strip() for k, v in info.items()}
    return f"{fields.get('model name', platform.machine())} [{fields.get('flags', '')}]"


def _compiler() -> str | None:
    return shutil.which("g++") or shutil.which("c++")


def _flags() -> list[str]:
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        "-O3",
        "-march=native",
        "-std=c++20",
        "-fPIC",
        # no contraction of a * b + c into an FMA: one source line must round the same way in
        # every function it is inlined into (batch invariance)
        "-ffp-contract=off",
        "-fopenmp",  # at::parallel_for's OpenMP region (torch's own libgomp is already loaded)
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
    ]


def _link(objects: list[Path], output: Path) -> list[str]:
    torch_lib = Path(torch.__file__).parent / "lib"
    return [
        *map(str, objects),
        "-shared",
        "-fopenmp",
        "-o",
        str(output),
        f"-L{torch_lib}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_lib}",
    ]


def library_path(cache_dir: str | None, compiler: str) -> Path:
    """Where the build for this source, CPU, torch and compiler lives."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout.splitlines()[:1]
    key = hashlib.sha256()
    files = [path.read_bytes() for path in (*SOURCES, *HEADERS)]
    for part in (*files, cpu_identity(), torch.__version__, version):
        key.update(repr(part).encode())
    return cache_root(cache_dir) / "native" / f"ladle_native-{key.hexdigest()[:16]}.so"


def installed_dir() -> Path:
    """Where `make install` puts the build (inside the environment, beside its packages)."""
    return installed_root() / "native"


def _build(compiler: str, output: Path) -> None:
    """Compile every source at once (one process each), then link; atomic for the target."""
    output.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load half a file.
    with tempfile.TemporaryDirectory(dir=output.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        compiles = [
            subprocess.Popen(
                [compiler, *_flags(), "-c", str(source), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        errors = [p.communicate(timeout=BUILD_TIMEOUT_S)[1] for p in compiles]
        failed = [e for p, e in zip(compiles, errors, strict=True) if p.returncode != 0]
        if failed:
            raise RuntimeError(f"{compiler} failed: {failed[0].strip()[-2000:]}")
        partial = Path(tmp) / output.name
        linked = subprocess.run(
            [compiler, *_link(objects, partial)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        if linked.returncode != 0:
            raise RuntimeError(f"linking failed: {linked.stderr.strip()[-2000:]}")
        partial.replace(output)


def load(cache_dir: str | None = None) -> bool:
    """Build (once per machine) and load the native ops; False, with the reason logged, if not."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    loaded, reason = False, ""
    compiler = _compiler()
    if os.uname().machine not in ("x86_64", "AMD64"):
        reason = f"no native kernels for {os.uname().machine}"
    elif compiler is None:
        reason = "no C++ compiler (g++) on PATH"
    else:
        try:
            path = library_path(cache_dir, compiler)
            installed = installed_dir() / path.name
            path = installed if not path.exists() and installed.exists() else path
            built = not path.exists()
            started = time.perf_counter()
            if built:
                _build(compiler, path)
            torch.ops.load_library(str(path))
            ops = torch.ops.ladle_native
            loaded = bool(ops.available()) or bool(ops.f32_available())
            reason = "" if loaded else "this CPU has neither AVX512-BF16 nor AVX2 with FMA"
            _state["bf16"] = loaded and bool(ops.available())
            how = "built at" if built else "loaded from"
            logger.info("native kernels %s %s (%.1f s)", how, path, time.perf_counter() - started)
            if loaded:
                choose_prefetch_level(path)
                _state["int4_kernel"] = _state["int4_kernel_measured"] = choose_int4_kernel(path)
                tiles = choose_attention_tiles(path)
                _state["attention_tiles"] = _state["attention_tiles_measured"] = tiles
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            reason = f"build or load failed: {exc}"
    _state.update(loaded=loaded, reason=reason)
    if not loaded:
        logger.info("native kernels not used: %s", reason)
    return loaded


def _probe_bytes() -> int:
    """Weights for the prefetch probe: twice the last-level cache (from sysfs), 64-256 MB, so
    they stream from memory as a decode step's do."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        llc = int(text.rstrip("KkMm")) * (1 << 20 if text[-1] in "Mm" else 1 << 10)
    except (OSError, ValueError, IndexError):
        llc = 32 << 20
    return min(max(2 * llc, 64 << 20), 256 << 20)


def measure_prefetch_levels(rounds: int = 7) -> dict[int, float]:
    """Median seconds of one-row int4 passes over weights past the caches, per prefetch level
    (0: into L1, 1: into L2), the levels alternating round by round."""
    ops = torch.ops.ladle_native
    n, k = 3072, 576  # a gate_up_proj of the default model: 1.1 MB packed
    cell = (n // 16) * (k // 32) * 320
    weights = [torch.zeros(cell, dtype=torch.uint8) for _ in range(_probe_bytes() // cell)]
    if bf16():
        x, gemm = torch.ones(1, k, dtype=torch.bfloat16), ops.gemm_int4
    else:
        x, gemm = torch.ones(1, k), ops.gemm_int4_f32
    times: dict[int, list[float]] = {0: [], 1: []}
    previous = ops.set_prefetch_level(1)
    try:
        for round_ in range(rounds + 1):
            for level in (0, 1):
                ops.set_prefetch_level(level)
                started = time.perf_counter()
                for packed in weights:
                    gemm(x, packed, n, None)
                if round_:  # the first round warms up
                    times[level].append(time.perf_counter() - started)
    finally:
        ops.set_prefetch_level(previous)
    return {level: sorted(t)[len(t) // 2] for level, t in times.items()}


def choose_prefetch_level(library: Path) -> int:
    """Set the grouped kernels' prefetch level (see gemm.h) to the one measured faster on this
    machine: measured once and kept beside the library (it is built per CPU)."""
    record = library.with_name(f"{library.stem}.prefetch.json")
    try:
        level = int(json.loads(record.read_text())["level"])
    except (OSError, ValueError, KeyError, TypeError):
        started = time.perf_counter()
        try:
            seconds = measure_prefetch_levels()
        except RuntimeError as exc:  # never worth losing the kernels over
            logger.warning("prefetch level not measured (%s): into L2", exc)
            return 1
        level = min(seconds, key=lambda lv: seconds[lv])
        logger.info(
            "prefetch into L%d: one-row int4 passes %.2f ms into L1, %.2f ms into L2 (%.2f s)",
            level + 1,
            seconds[0] * 1e3,
            seconds[1] * 1e3,
            time.perf_counter() - started,
        )
        try:
            record.write_text(json.dumps({"level": level, "seconds": seconds}))
        except OSError:
            pass  # a read-only install: measured again next start
    torch.ops.ladle_native.set_prefetch_level(level)
    return level


# Rows the int4 kernels are timed at: the decode buckets and a prefill chunk's pass.
INT4_PROBE_ROWS = (1, 4, 16, 64, 256)


def int4_kernels_here() -> tuple[str, ...]:
    """The int4 kernels for bf16 activations this CPU has: "avx512" (`vdpbf16ps` on bf16 x),
    "vnni" (x quantized to int8 per group of 32, `vpdpbusd`), "amx" (tile sums)."""
    if not _state.get("bf16"):  # (set before `load` has finished)
        return ()
    ops = torch.ops.ladle_native
    return (
        ("avx512",)
        + (("vnni",) if ops.int8_available() else ())  # the VNNI kernels: int8 and int4
        + (("amx",) if ops.int4_amx_usable(3072, 576) else ())
    )


def measure_int4_kernels(rounds: int = 5) -> dict[str, dict[int, float]]:
    """Median seconds per row count of the int4 kernels this CPU has (`int4_kernels_here`)
    over a default-model layer's weights (gate_up and down, 8 copies each, the kernels
    alternating), for `choose_int4_kernel`."""
    ops = torch.ops.ladle_native
    layers = []
    for n, k in ((3072, 576), (576, 1536)):
        cell = (n // 16) * (k // 32) * 320  # the size of both layouts (float16 scales)
        layers += [(n, k, torch.zeros(cell, dtype=torch.uint8)) for _ in range(8)]
    xs = {rows: torch.randn(rows, 1536).to(torch.bfloat16) for rows in INT4_PROBE_ROWS}

    def run(rows: int, kernel: str) -> None:
        for n, k, packed in layers:
            if kernel == "vnni":
                ops.gemm_int4_q8(xs[rows][:, :k], packed, n, None)
            else:
                ops.gemm_int4(xs[rows][:, :k], packed, n, None, kernel == "amx")

    return _alternating_medians(
        {
            rows: {kernel: functools.partial(run, rows, kernel) for kernel in int4_kernels_here()}
            for rows in INT4_PROBE_ROWS
        },
        rounds,
    )


def _alternating_medians(
    calls: dict[Any, dict[str, Callable[[], object]]], rounds: int
) -> dict[str, dict[Any, float]]:
    """Median seconds of each kernel's call per probe ({probe: {kernel: call}}), the probes and
    kernels alternating within each of `rounds` rounds after one that warms up."""
    times: dict[str, dict[Any, list[float]]] = {}
    for round_ in range(rounds + 1):
        for probe, by_kernel in calls.items():
            for kernel, call in by_kernel.items():
                started = time.perf_counter()
                call()
                if round_:
                    times.setdefault(kernel, {}).setdefault(probe, []).append(
                        time.perf_counter() - started
                    )
    return {
        kernel: {probe: sorted(t)[len(t) // 2] for probe, t in by_probe.items()}
        for kernel, by_probe in times.items()
    }


def choose_int4_kernel(library: Path) -> str:
    """The kernel bf16 int4 layers run on here (one kernel for every row count: they sum in
    different orders). Where the CPU has more than one (`int4_kernels_here`), each is timed
    once per machine at `INT4_PROBE_ROWS` and the one whose times, each relative to that row
    count's fastest, add up least is kept beside the library, as the kernel plan picks."""
    kernels = int4_kernels_here()
    if len(kernels) < 2:
        return "avx512"
    return _kept_or_timed(library, "int4", measure_int4_kernels, kernels)


def _kept_or_timed(
    library: Path,
    what: str,
    measure: Callable[[], dict],
    kernels: tuple[str, ...] = ("avx512", "amx"),
) -> str:
    """The kernel (one of `kernels`) kept for `what` beside `library`; else each timed
    (`measure`: seconds per kernel and probe) and the one of the least `_relative_costs`
    kept there ("avx512" where timing fails: never worth losing the kernels over)."""
    record = library.with_name(f"{library.stem}.{what}.json")
    try:
        kept = str(json.loads(record.read_text())["kernel"])
        if kept in kernels:
            return kept
    except (OSError, ValueError, KeyError, TypeError):
        pass
    started = time.perf_counter()
    try:
        seconds = measure()
    except RuntimeError as exc:
        logger.warning("%s kernels not timed (%s): AVX-512", what, exc)
        return "avx512"
    cost = _relative_costs(seconds)
    kernel = min(sorted(cost), key=cost.__getitem__)
    logger.info(
        "%s on %s: relative time summed over %s: %s (%.2f s)",
        what,
        kernel,
        "/".join(map(str, seconds[kernel])),
        ", ".join(f"{name} {cost[name]:.2f}" for name in sorted(cost)),
        time.perf_counter() - started,
    )
    try:
        record.write_text(json.dumps({"kernel": kernel, "seconds": seconds}))
    except OSError:
        pass  # a read-only install: measured again next start
    return kernel


def select_int4_kernel(name: str) -> None:
    """The int4 kernel of the models loaded from now on (`LLM_INT4_KERNEL`): "auto" (the one
    `choose_int4_kernel` kept), "avx512", "vnni" or "amx" (where this CPU has it, else a
    warning and avx512). Set before a model loads, never while it serves: a row must sum
    the same way all along."""
    if name == "auto":
        _state["int4_kernel"] = _state.get("int4_kernel_measured", "avx512")
        return
    if name not in int4_kernels_here():
        logger.warning("LLM_INT4_KERNEL=%s: this CPU has no such int4 kernel; avx512 it is", name)
        name = "avx512"
    _state["int4_kernel"] = name


def _select(setting: str, name: str, key: str, usable: bool) -> None:
    """`_state[key]`: whether the AMX kernel runs, as `setting`'s value `name` says ("auto":
    the one measured at load); where AMX is not `usable` here, a warning for "amx" (the
    readers check usability themselves)."""
    if name == "amx" and not usable:
        logger.warning("%s=amx: this CPU has no AMX kernel for it; AVX-512 it is", setting)
    measured = bool(_state.get(f"{key}_measured"))
    _state[key] = measured if name == "auto" else name == "amx"


def int4_amx_usable(out_features: int, in_features: int) -> bool:
    """Whether `gemm_int4(..., amx=True)` takes this shape here (AMX, whole sets of 64 outputs)."""
    return bf16() and bool(torch.ops.ladle_native.int4_amx_usable(out_features, in_features))


def int4_kernel(out_features: int, in_features: int) -> str:
    """The kernel a bf16 int4 weight of this shape runs on here: the one `choose_int4_kernel`
    kept (or `LLM_INT4_KERNEL` named), except "amx" for a shape the tiles do not take."""
    kernel = str(_state.get("int4_kernel", "avx512"))
    if kernel == "amx" and not int4_amx_usable(out_features, in_features):
        return "avx512"
    return kernel


def prebuild(into: Path) -> Path | None:
    """Build into `into` (install time), under the name a start looks for; None: no compiler."""
    compiler = _compiler()
    if compiler is None:
        return None
    path = into / library_path(None, compiler).name
    if not path.exists():
        _build(compiler, path)
    return path


def configure(enabled: bool, cache_dir: str | None = None) -> bool:
    """Use the native kernels from now on (loading them first), or stop using them."""
    _state["enabled"] = enabled and load(cache_dir)
    return bool(_state["enabled"])


def loaded() -> bool:
    """Whether the native kernels are loaded and in use (`configure`) in this process."""
    return bool(_state.get("loaded")) and bool(_state.get("enabled", True))


def bf16() -> bool:
    """Whether the bf16 kernels (bf16, int4 and int8 matmuls on bf16 activations, bf16
    attention, the bf16 small ops) are in use: a CPU with AVX512-BF16. A CPU with only AVX2
    and FMA has the float32 ones alone (matmul, int4 and int8 on float32 activations,
    attention, small ops, the layer stack), which serve a float32 model."""
    return loaded() and bool(_state.get("bf16"))


_SUFFIXES = {torch.bfloat16: "bf16", torch.float32: "f32"}


def serves(t: torch.Tensor) -> bool:
    """Whether the fused small ops (and so the layer stack) serve a model whose weights are
    like t: on CPU, in bf16 with the bf16 kernels, in float32 with any native kernels."""
    return serves_dtype(t.dtype, t.device)


def serves_dtype(dtype: torch.dtype, device: torch.device) -> bool:
    """`serves` for activations of `dtype` on `device`, without a tensor of them."""
    if device.type != "cpu":
        return False
    return bf16() if dtype == torch.bfloat16 else dtype == torch.float32 and loaded()


@functools.cache
def op(name: str, dtype: torch.dtype) -> Any:
    """The fused small op `name` for `dtype` activations: ("rms_norm", torch.float32) is
    `ladle_native.rms_norm_f32`, ("rotary_", torch.bfloat16) `ladle_native.rotary_bf16_`."""
    base, in_place = name.removesuffix("_"), "_" if name.endswith("_") else ""
    return getattr(torch.ops.ladle_native, f"{base}_{_SUFFIXES[dtype]}{in_place}")


def status() -> str:
    """In one phrase, for logs: loaded, not tried, or why not."""
    if "loaded" not in _state:
        return "not tried"
    if not _state["loaded"]:
        return str(_state["reason"])
    return "loaded" if _state.get("bf16") else "loaded (float32 only: no AVX512-BF16 here)"


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K/2, 16, 2]: the layout `ladle_native.gemm_bf16` streams."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N/16, K, 16]: the layout `ladle_native.gemm_f32` streams."""
    n, k = weight.shape
    return weight.reshape(n // 16, 16, k).permute(0, 2, 1).contiguous()


def packable(weight: torch.Tensor) -> bool:
    """Whether `pack_bf16` or `pack_f32` takes this weight and a native matmul serves it here."""
    n, k = weight.shape
    if weight.dtype == torch.float32:
        return loaded() and n % 16 == 0
    return weight.dtype == torch.bfloat16 and bf16() and n % 16 == 0 and k % 2 == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The native matmul's layout for this weight's dtype."""
    return pack_f32(weight) if weight.dtype == torch.float32 else pack_bf16(weight)


def attention_supported(head_dim: int, group: int) -> bool:
    """Shapes `ladle_native.paged_attention_rows` handles (head_dim, query heads per KV head)."""
    return head_dim in (32, 64, 96, 128, 192, 256) and 1 <= group <= 16


def attention_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    starts: torch.Tensor | None = None,
    softcap: float | None = None,
    packed_keys: bool = False,
    tiles: bool = False,
) -> torch.Tensor:
    """`ladle_native.paged_attention_rows`: each row over positions [start, context_len)
    of its block table (start 0 without `starts`), scores soft-capped where `softcap`;
    `packed_keys`: k_cache holds its keys packed (see `pack_keys`); `tiles`: on the AMX
    tiles (bf16, packed keys and values (`pack_values`), `attention_tiles_usable`), which
    sum in another order."""
    return torch.ops.ladle_native.paged_attention_rows(
        q, k_cache, v_cache, tables, context_lens, scale, starts, softcap or 0.0, packed_keys, tiles
    )


def attention_tiles_usable() -> bool:
    """Whether `attention_rows(..., tiles=True)` runs here (AVX512-BF16 and AMX)."""
    return bf16() and bool(torch.ops.ladle_native.attention_tiles_usable())


# What the attention kernels are timed at (the default model's heads, 16-position blocks):
# (rows, cached positions per row, one sequence's prefill or separate sequences' decode).
ATTENTION_PROBES = ((1, 512, False), (16, 512, False), (512, 512, True))


def measure_attention_kernels(rounds: int = 5) -> dict[str, dict[str, float]]:
    """Median seconds per probe (`ATTENTION_PROBES`) of the row attention on vectors
    ("avx512") and on the AMX tiles ("amx"), the two alternating, for
    `choose_attention_tiles`."""
    heads, kv_heads, dim, block = 9, 3, 64, 16
    blocks = 16 * 512 // block
    # (the values' layout does not change the time: the tiles read them packed)
    k_cache = pack_keys(torch.randn(kv_heads, blocks, block, dim).to(torch.bfloat16))
    v_cache = torch.randn(kv_heads, blocks, block, dim).to(torch.bfloat16)

    def run(q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, repeats: int, tiles: bool):
        for _ in range(repeats):
            attention_rows(q, k_cache, v_cache, tables, lens, 0.125, None, None, True, tiles)

    calls = {}
    for rows, context, prefill in ATTENTION_PROBES:
        per_row = context // block
        if prefill:
            tables = torch.arange(per_row).repeat(rows, 1)
            lens = torch.arange(context - rows + 1, context + 1)
        else:
            tables = torch.arange(rows * per_row).view(rows, per_row)
            lens = torch.full((rows,), context)
        case = (
            torch.randn(rows, heads, dim).to(torch.bfloat16),
            tables,
            lens,
            2 if prefill else 20,
        )
        calls[f"{'prefill' if prefill else 'decode'} {rows}x{context}"] = {
            "avx512": functools.partial(run, *case, False),
            "amx": functools.partial(run, *case, True),
        }
    return _alternating_medians(calls, rounds)


def choose_attention_tiles(library: Path) -> bool:
    """Whether bf16 row attention runs on the AMX tiles here (for every row: the two kernels
    sum in different orders). Where the CPU has them, both are timed once per machine at
    `ATTENTION_PROBES` and the one whose times, each relative to that probe's faster, add up
    least is kept beside the library."""
    ops = torch.ops.ladle_native
    if not ops.available() or not ops.attention_tiles_usable():
        return False
    return _kept_or_timed(library, "attention", measure_attention_kernels) == "amx"


def _relative_costs(seconds: dict[str, dict]) -> dict[str, float]:
    """Per kernel, its times summed, each relative to the fastest kernel at that probe."""
    return {
        name: sum(t / min(by[probe] for by in seconds.values()) for probe, t in by_probe.items())
        for name, by_probe in seconds.items()
    }


def select_attention_kernel(name: str) -> None:
    """The row attention kernel of the models loaded from now on (`LLM_ATTENTION_KERNEL`):
    "auto" (the one `choose_attention_tiles` kept), "avx512" or "amx" (still only where
    `attention_tiles_usable`). Set before a model loads: a row must sum the same way all
    along."""
    _select("LLM_ATTENTION_KERNEL", name, "attention_tiles", attention_tiles_usable())


def attention_tiles() -> bool:
    """Whether bf16 row attention over packed keys runs on the AMX tiles here."""
    return bool(_state.get("attention_tiles")) and attention_tiles_usable()


def pack_keys(k_cache: torch.Tensor) -> torch.Tensor:
    """A plain key cache [Hkv, blocks, block_size, D] laid out as the row kernel's packed keys
    (attention.cpp): per run of 16 positions, feature steps outer (pairs in bf16, single
    features in float32) and the 16 positions inner. Same shape; for tests and benchmarks,
    the engine writes packed keys directly (`write_kv(..., packed_keys=True)`)."""
    hkv, blocks, bs, d = k_cache.shape
    step = 2 if k_cache.dtype == torch.bfloat16 else 1
    runs = k_cache.reshape(hkv, blocks, bs // 16, 16, d // step, step)
    return runs.permute(0, 1, 2, 4, 3, 5).contiguous().view(hkv, blocks, bs, d)


def pack_values(v_cache: torch.Tensor) -> torch.Tensor:
    """A plain bf16 value cache [Hkv, blocks, block_size, D] laid out as the tile kernel's
    packed values (attention.cpp): per run of 16 positions, [D/16][8 position pairs][16
    features][2]. Same shape; for tests and benchmarks, the engine writes them directly
    (`write_kv(..., packed_values=True)`)."""
    hkv, blocks, bs, d = v_cache.shape
    runs = v_cache.reshape(hkv, blocks, bs // 16, 8, 2, d // 16, 16)
    return runs.permute(0, 1, 2, 5, 3, 6, 4).contiguous().view(hkv, blocks, bs, d)


def amx_usable(out_features: int, in_features: int) -> bool:
    """Whether `gemm_bf16(..., amx=True)` takes the AMX path for this weight shape here."""
    return bf16() and bool(torch.ops.ladle_native.amx_usable(out_features, in_features))


def int4_packable(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether `ladle_native.gemm_int4` takes this int4 weight (groups of 32 inputs)."""
    return bf16() and group_size == 32 and out_features % 16 == 0 and in_features % 32 == 0


def int4_f32_packable(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether `ladle_native.gemm_int4_f32` (float32 x, AVX2) takes this int4 weight."""
    return loaded() and group_size == 32 and out_features % 16 == 0 and in_features % 32 == 0


def pack_int4(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """int4 [N, K] (0..15) with per-group scale and min ([N, K/32]; w = q s + m) ->
    uint8 [N/16, K/32, 384], the layout `ladle_native.gemm_int4` streams: per block of 16
    rows and group, 8 chunks of 32 bytes holding k-pairs 2c (low nibbles) and 2c+1 (high)
    as in `pack_bf16`, then the 16 rows' float32 scales, then their float32 mins.

    Where every scale and min is a float16 exactly (a GGUF's Q4_0 or Q4_1, our own int4),
    they are stored as float16 instead: [N/16, K/32, 320], a sixth fewer bytes per decode
    step and the same float32 values in the kernel (it tells the layouts apart by size)."""
    n, k = values.shape
    blocks, groups = n // 16, k // 32
    # (block, row, group, chunk, nibble, e) -> (block, group, chunk, nibble, row, e)
    q = values.to(torch.uint8).reshape(blocks, 16, groups, 8, 2, 2).permute(0, 2, 3, 4, 1, 5)
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(blocks, groups, 256)
    return torch.cat([nibbles, _int4_meta(scales, mins)], dim=2).contiguous()


def pack_int4_q8(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The same weight in the layout the int8-x kernels stream (`ladle_native.gemm_int4_f32`:
    float32 x, AVX2; `gemm_int4_q8`: bf16 x, AVX-512 VNNI): as `pack_int4`, but per block and
    group 4 chunks of 64 bytes; chunk c's byte 4j + e holds row j's input 8c + e (low nibble)
    and 8c + 4 + e (high), so that one `vpdpbusd` multiplies 16 rows' 4 inputs by a quad of
    x broadcast from memory (AVX2's `vpmaddubsw` takes a chunk's two halves of 8 rows)."""
    n, k = values.shape
    blocks, groups = n // 16, k // 32
    # (block, row, group, chunk, nibble, e) -> (block, group, chunk, row, e, nibble)
    q = values.to(torch.uint8).reshape(blocks, 16, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (q[..., 0] | (q[..., 1] << 4)).reshape(blocks, groups, 256)
    return torch.cat([nibbles, _int4_meta(scales, mins)], dim=2).contiguous()


def _int4_meta(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Per block of 16 rows and group: the rows' scales, then their mins, as float16 where
    every one is a float16 exactly, else as float32 ([N/16, K/32, 64 or 128] bytes)."""
    n, groups = scales.shape
    dtype = torch.float16 if is_half_exact(scales) and is_half_exact(mins) else torch.float32

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [blocks, G, 16 values' bytes]
        rows = t.to(dtype).reshape(n // 16, 16, groups).permute(0, 2, 1).contiguous()
        return rows.view(torch.uint8).reshape(n // 16, groups, -1)

    return torch.cat([per_row(scales), per_row(mins)], dim=2)


def is_half_exact(t: torch.Tensor) -> bool:
    """Whether every value of `t` is a finite float16 exactly (widening gives it back)."""
    half = t.to(torch.float16)
    return bool(torch.isfinite(half).all()) and torch.equal(half.to(t.dtype), t)


def int8_packable(out_features: int, in_features: int) -> bool:
    """Whether `ladle_native.gemm_int8` takes this weight shape (groups of 32 inputs) on this
    CPU (it needs AVX512-VNNI besides the bf16 kernels' AVX512-BF16)."""
    return (
        bf16()
        and bool(torch.ops.ladle_native.int8_available())
        and out_features % 16 == 0
        and in_features % 32 == 0
    )


def int8_f32_packable(out_features: int, in_features: int) -> bool:
    """Whether `ladle_native.gemm_int8_f32` (float32 x, AVX2) takes this weight shape."""
    return loaded() and out_features % 16 == 0 and in_features % 32 == 0


def pack_int8(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] with one scale per row and group of 32 inputs ([N, K/32]; w = q s) ->
    uint8 [N/16, K/32, 576], the layout `ladle_native.gemm_int8` streams: per block of 16
    rows and group, 8 chunks of 64 bytes (lane n: row n's next 4 weights, each + 128, as
    `vpdpbusd`'s unsigned operand), then the 16 rows' float32 scales."""
    n, k = values.shape
    blocks, groups = n // 16, k // 32
    biased = (values.to(torch.int16) + 128).to(torch.uint8)
    # (block, row, group, chunk, byte) -> (block, group, chunk, row, byte)
    chunks = biased.reshape(blocks, 16, groups, 8, 4).permute(0, 2, 3, 1, 4)
    rows = scales.to(torch.float32).reshape(blocks, 16, groups).permute(0, 2, 1).contiguous()
    scale_bytes = rows.view(torch.uint8).reshape(blocks, groups, 64)
    return torch.cat([chunks.reshape(blocks, groups, 512), scale_bytes], dim=2).contiguous()

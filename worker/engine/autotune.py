"""Linear kernels and decode threads chosen by measuring on the machine at hand, at load.

For each batch bucket (rows of a step) and each group of same-shaped linears (every qkv_proj,
every down_proj, ...) every registered kernel (`worker/layers/linear_kernels.py`) is timed
over all layers of the group in turn, so weights stream from memory as in a real step rather
than sitting in cache. Decode buckets are timed on 1 thread and on all; the thread count with
the smaller total wins for decode-only steps of that bucket (prefill always uses every
thread). The winners become each layer's `BucketedKernel`; losers are dropped.

Batch invariant plans (`LLM_DETERMINISTIC`, the default) time only the kernels that sum a row
the same way at every row count, and give each group one of them for every bucket: the one
whose times, each relative to that bucket's fastest, add up least. Where each group has only
one such kernel (no AMX: `native`), there is nothing to time: that plan is used at once, and
the decode threads are found while serving. A plan never changes while a worker serves: a
kernel changed mid-run would change how a row sums.

The plan is cached as JSON under `{cache}/kernels/`, keyed by CPU model, flags, torch version,
thread count, dtype, shapes and candidates, so a restart on the same machine skips the
timing. `LLM_LINEAR_KERNEL` names one kernel to use everywhere instead (no timing).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from shared.config import openmp_settings
from shared.model_files import cache_root
from worker.layers import native
from worker.layers.linear import Linear
from worker.layers.linear_kernels import BucketedKernel, LinearKernel, build_kernel, kernel_names

logger = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 4, 16, 64)
PREFILL_BUCKET = 256  # rows above the largest decode bucket: prefill chunks


@dataclass
class KernelPlan:
    """Per bucket (max rows, as a string key): kernel per linear group, and decode threads."""

    kernels: dict[str, dict[str, str]]  # group -> bucket -> kernel name
    threads: dict[str, int] = field(default_factory=dict)  # decode bucket -> threads
    source: str = "measured"  # measured | cache | setting
    seconds: float = 0.0
    load: float = 0.0  # 1-minute load average when the timing started
    invariant: bool = False  # one batch-invariant kernel per group for every bucket

    def threads_for(self, rows: int) -> int | None:
        """The measured thread count for a decode step of `rows` rows (None: no opinion)."""
        for bucket in sorted(self.threads, key=int):
            if rows <= int(bucket):
                return self.threads[bucket]
        return self.threads[max(self.threads, key=int)] if self.threads else None

    def bucket_for(self, rows: int) -> int:
        """The smallest decode bucket holding `rows` (the largest when none does)."""
        buckets = sorted(int(b) for b in self.threads) or sorted(
            {int(b) for choice in self.kernels.values() for b in choice}
        )
        return next((b for b in buckets if rows <= b), buckets[-1] if buckets else rows)

    def summary(self) -> dict[str, str]:
        """bucket -> "qkv_proj=prepacked ... threads=1": what a worker record shows."""
        buckets = sorted({b for choice in self.kernels.values() for b in choice}, key=int)
        out = {}
        for bucket in buckets:
            names = [  # "qkv_proj:576x960" -> "qkv_proj"
                f"{group.split(':')[0]}={choice[bucket]}" for group, choice in self.kernels.items()
            ]
            if bucket in self.threads:
                names.append(f"threads={self.threads[bucket]}")
            out[bucket] = " ".join(names)
        return out


def linear_groups(model: nn.Module) -> dict[str, list[Linear]]:
    """Float linears grouped by name suffix and shape: each group times as one.

    Weight-only quantized layers (`LLM_QUANTIZATION`) are left out: their kernel is fixed.
    """
    groups: dict[str, list[Linear]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized is None:
            key = f"{name.rsplit('.', 1)[-1]}:{module.in_features}x{module.out_features}"
            groups.setdefault(key, []).append(module)
    return groups


def buckets_for(max_num_seqs: int) -> list[int]:
    decode = [b for b in DECODE_BUCKETS if b < max_num_seqs] + [max_num_seqs]
    return sorted({*decode, max(PREFILL_BUCKET, max_num_seqs)})


def _time_group(
    kernels: list[LinearKernel], x: torch.Tensor, min_passes: int = 5, min_seconds: float = 0.03
) -> float:
    """Fastest of several passes over every layer of the group (at least `min_passes` and
    `min_seconds` of passes, after one warm-up): the minimum, because a pass is only ever
    slowed by what else the machine does, and small groups need many passes to see it."""
    times: list[float] = []
    for _ in range(1 + min_passes):  # the first is a warm-up
        started = time.perf_counter()
        for kernel in kernels:
            kernel(x)
        times.append(time.perf_counter() - started)
    while sum(times[1:]) < min_seconds:
        started = time.perf_counter()
        for kernel in kernels:
            kernel(x)
        times.append(time.perf_counter() - started)
    return min(times[1:])


def _measure_group(
    layers: list[Linear],
    buckets: list[int],
    thread_options: list[int],
    dtype: torch.dtype,
    invariant: bool,
) -> dict[tuple[int, int], dict[str, float]]:
    """(bucket, threads) -> kernel name -> seconds per pass, for every applicable kernel
    (only batch-invariant ones if `invariant`)."""
    results: dict[tuple[int, int], dict[str, float]] = {}
    for name in kernel_names():
        kernels = [build_kernel(name, layer.weight, layer.bias) for layer in layers]
        if any(kernel is None for kernel in kernels):
            continue
        if invariant and not all(kernel.batch_invariant for kernel in kernels):  # type: ignore[union-attr]
            continue
        for bucket in buckets:
            x = torch.randn(bucket, layers[0].in_features).to(dtype)
            for threads in thread_options if bucket < PREFILL_BUCKET else thread_options[-1:]:
                torch.set_num_threads(threads)
                results.setdefault((bucket, threads), {})[name] = _time_group(kernels, x)
        del kernels
    return results


@torch.inference_mode()
def measure_plan(
    model: nn.Module, buckets: list[int], max_threads: int, invariant: bool = False
) -> KernelPlan:
    """Time every kernel for every group, bucket and thread option; keep the fastest (per
    bucket, or, if `invariant`, one batch-invariant kernel per group for all buckets)."""
    started = time.perf_counter()
    dtype = next(model.parameters()).dtype
    thread_options = sorted({1, max_threads})
    times = {
        group: _measure_group(layers, buckets, thread_options, dtype, invariant)
        for group, layers in linear_groups(model).items()
    }
    torch.set_num_threads(max_threads)
    plan = KernelPlan(kernels={group: {} for group in times}, invariant=invariant)
    chosen: dict[str, dict[int, dict[str, float]]] = {group: {} for group in times}
    for bucket in buckets:
        # groups no kernel applies to (an MoE router of 4 outputs) have no times: left out
        timed = [by for by in times.values() if by]
        options = [t for t in thread_options if timed and (bucket, t) in timed[0]]
        total = {t: sum(min(by[(bucket, t)].values()) for by in timed) for t in options}
        threads = min(total, key=total.__getitem__) if total else max_threads
        if bucket < PREFILL_BUCKET:
            plan.threads[str(bucket)] = threads
        for group, by in times.items():
            chosen[group][bucket] = by.get((bucket, threads), {})
    for group, by_bucket in chosen.items():
        for bucket, name in _pick(by_bucket, invariant).items():
            plan.kernels[group][str(bucket)] = name
    plan.seconds = time.perf_counter() - started
    return plan


def _pick(by_bucket: dict[int, dict[str, float]], invariant: bool) -> dict[int, str]:
    """bucket -> kernel: each bucket's fastest, or one kernel for all (least relative time).
    A group no kernel was timed for (none applies) gets `plain`."""
    if not all(by_bucket.values()):
        return {bucket: "plain" for bucket in by_bucket}
    if not invariant:
        return {bucket: min(t, key=t.__getitem__) for bucket, t in by_bucket.items()}
    names = set.intersection(*(set(t) for t in by_bucket.values()))
    if not names:
        return {bucket: "plain" for bucket in by_bucket}
    cost = {n: sum(t[n] / min(t.values()) for t in by_bucket.values()) for n in names}
    best = min(sorted(cost), key=cost.__getitem__)
    return {bucket: best for bucket in by_bucket}


def fixed_plan(model: nn.Module, name: str, buckets: list[int]) -> KernelPlan:
    """`name` for every group and bucket (the `LLM_LINEAR_KERNEL` override)."""
    build_kernel(name, torch.zeros(1, 1), None)  # unknown names fail here, early
    groups = linear_groups(model)
    return KernelPlan({g: {str(b): name for b in buckets} for g in groups}, source="setting")


def only_invariant_kernels(model: nn.Module) -> dict[str, str] | None:
    """group -> its one batch-invariant kernel, when each group has exactly one (a CPU
    without AMX: `native`). Timing could then only pick those; the decode threads are chosen
    while serving anyway (worker/engine/threads.py). None when some group has a choice."""
    only: dict[str, str] = {}
    for group, layers in linear_groups(model).items():
        layer = layers[0]
        fits = [
            name
            for name in kernel_names()
            if getattr(build_kernel(name, layer.weight, layer.bias), "batch_invariant", False)
        ]
        if len(fits) > 1:
            return None
        only[group] = fits[0] if fits else "plain"
    return only


def plan_is_invariant(model: nn.Module) -> bool:
    """Whether every linear now runs one batch-invariant kernel (quantized ones included)."""
    return all(
        module.kernel is not None and getattr(module.kernel, "batch_invariant", False)
        for module in model.modules()
        if isinstance(module, Linear)
    )


def apply_plan(model: nn.Module, plan: KernelPlan) -> None:
    """Give every linear its per-bucket kernels (plain where a kernel does not apply)."""
    for group, layers in linear_groups(model).items():
        choice = plan.kernels.get(group, {})
        for layer in layers:
            built: dict[str, LinearKernel] = {}
            for name in set(choice.values()):
                kernel = build_kernel(name, layer.weight, layer.bias)
                built[name] = kernel or build_kernel("plain", layer.weight, layer.bias)
            if len(built) == 1:
                layer.set_kernel(next(iter(built.values())))
            elif built:
                layer.set_kernel(BucketedKernel([(int(b), built[n]) for b, n in choice.items()]))


def _add_quantized(model: nn.Module, plan: KernelPlan, buckets: list[int]) -> None:
    """Name the quantized layers' fixed kernels in the plan, so the worker record shows them."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized is not None:
            key = f"{name.rsplit('.', 1)[-1]}:{module.in_features}x{module.out_features}"
            plan.kernels[key] = {str(b): module.quantized.name for b in buckets}


def plan_cache_path(
    model: nn.Module,
    buckets: list[int],
    max_threads: int,
    cache_dir: str | None,
    invariant: bool = False,
):
    """The cache file for this CPU, torch, threads, OpenMP wait, shapes and candidates."""
    key = {
        "cpu": native.cpu_identity(),
        "torch": torch.__version__,
        "threads": max_threads,
        "openmp": openmp_settings(),
        "dtype": str(next(model.parameters()).dtype),
        "groups": sorted(linear_groups(model)),
        "buckets": buckets,
        "kernels": kernel_names(),
        # a plan naming native kernels is no use to a process that runs without them
        "native": native.loaded(),
        "invariant": invariant,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root(cache_dir) / "kernels" / f"{digest}.json"


def choose_kernels(
    model: nn.Module,
    setting: str,
    max_num_seqs: int,
    max_threads: int,
    cache_dir: str | None = None,
    invariant: bool = False,
) -> KernelPlan:
    """The plan for `setting` ("auto": measured or cached; else that kernel), applied.
    `invariant`: batch-invariant kernels only, one per group (`plan.invariant` says whether
    every linear got one)."""
    buckets = buckets_for(max_num_seqs)
    if setting != "auto":
        plan = fixed_plan(model, setting, buckets)
    elif next(model.parameters()).device.type != "cpu":
        plan = fixed_plan(model, "plain", buckets)
    else:
        plan = _cached_or_measured(model, buckets, max_threads, cache_dir, invariant)
    apply_plan(model, plan)
    _add_quantized(model, plan, buckets)
    plan.invariant = plan_is_invariant(model)
    logger.info("linear kernels (%s, %.1f s): %s", plan.source, plan.seconds, plan.summary())
    return plan


def _cached_or_measured(
    model: nn.Module,
    buckets: list[int],
    max_threads: int,
    cache_dir: str | None,
    invariant: bool,
) -> KernelPlan:
    only = only_invariant_kernels(model) if invariant else None
    if only is not None:  # nothing to choose between: no timing, nothing to cache
        kernels = {group: {str(b): name for b in buckets} for group, name in only.items()}
        return KernelPlan(kernels, source="only invariant kernel", invariant=True)
    path = plan_cache_path(model, buckets, max_threads, cache_dir, invariant)
    try:
        plan = KernelPlan(**json.loads(path.read_text()))
        plan.source = "cache"
        return plan
    except (OSError, ValueError, TypeError):
        pass
    load = os.getloadavg()[0]
    plan = measure_plan(model, buckets, max_threads, invariant)
    plan.load = load
    if load >= max_threads + 1:
        # Timings taken while other work held the cores say little about this machine (a
        # plan timed during a build chose plain matmuls on one thread where it idle picks
        # the native kernels on two): use it now, time again at the next start.
        logger.warning(
            "kernel plan timed at load %.1f on %d threads: used, not cached", load, max_threads
        )
        return plan
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(plan), indent=1))
    except OSError as exc:
        logger.warning("could not cache the kernel plan in %s: %s", path, exc)
    return plan

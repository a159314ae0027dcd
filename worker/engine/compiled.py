"""The model's forward compiled by inductor (CPU): a few fused kernels instead of ~6,000 ops.

Eagerly, a small model's decode step is mostly per-op overhead (docs/benchmarks.md,
"Profile: where the time goes"). Compiled, the norms, rotary, SiLU-mul and residual adds of a
layer become a few C++/OpenMP loops; the matmuls (`ladle::linear`) and the
paged attention (`ladle::paged_attention`) stay opaque custom ops, so any weight layout and
the ragged per-step metadata stay out of the graph. Shapes: the token count is dynamic, so
one graph serves T = 1 (specialised) and one every T >= 2; both are compiled at start, and a
call that would compile again runs eagerly instead (the request path never compiles).
Inductor's FX graph cache lives under the Ladle cache directory, so a
restart reuses the generated code.

`LLM_COMPILE`: `off` eager; `on` compiled (any failure logs and falls back to eager);
`auto` compiled on CPU if the compiled decode step measures faster than eager at start.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from shared.config import apply_inductor_cache_dir
from shared.model_files import cache_root
from worker.layers.context import AttentionMetadata, PrefillChunkMeta, set_attention_metadata

logger = logging.getLogger(__name__)

CompileMode = Literal["auto", "on", "off"]
Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # a model, or CompiledForward


class CompiledForward:
    """The model with compiled decoder layers; a shape not compiled yet runs eagerly (logged)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._warned = False

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        try:
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=True):
                return self.model(input_ids, positions)
        except Exception as exc:  # a recompile, or an inductor bug: never fail the request
            if not self._warned:
                logger.warning("compiled forward refused %d tokens: %r", len(input_ids), exc)
                self._warned = True
            with torch.compiler.set_stance("force_eager"):
                return self.model(input_ids, positions)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (the first ModuleList): compiled once, reused by every layer."""
    return next((list(m) for m in model.modules() if isinstance(m, nn.ModuleList)), [])


def _uncompile(layers: list[nn.Module]) -> None:
    for layer in layers:
        layer._compiled_call_impl = None


def _warm_up_metadata(
    num_tokens: int, is_decode: bool, scratch_block: int, block_size: int, local: int | None = None
):
    """Metadata that writes only into the scratch block (never handed out by the manager);
    `local`: the sliding-window layers' own scratch block, where they have a pool."""
    meta = _scratch_metadata(num_tokens, is_decode, scratch_block, block_size)
    if local is not None:
        meta.local = _scratch_metadata(num_tokens, is_decode, local, block_size)
    return meta


def _scratch_metadata(num_tokens: int, is_decode: bool, scratch_block: int, block_size: int):
    slots = scratch_block * block_size + torch.arange(num_tokens) % block_size
    if not is_decode:
        return AttentionMetadata(slots, prefills=[PrefillChunkMeta(0, num_tokens, 0)])
    return AttentionMetadata(
        slots,
        num_decode_tokens=num_tokens,
        decode_block_tables=torch.full((num_tokens, 1), scratch_block, dtype=torch.long),
        decode_mask=torch.zeros(num_tokens, 1, block_size),
    )


def run_with_metadata(
    forward: Forward,
    num_tokens: int,
    is_decode: bool,
    scratch_block: int,
    block_size: int,
    local: int | None = None,
) -> float:
    """One forward of dummy tokens (scratch-block K/V only); returns its wall time in s."""
    meta = _warm_up_metadata(num_tokens, is_decode, scratch_block, block_size, local)
    ids = torch.zeros(num_tokens, dtype=torch.long)
    positions = torch.arange(num_tokens) % block_size
    set_attention_metadata(meta)
    try:
        started = time.perf_counter()
        forward(ids, positions)
        return time.perf_counter() - started
    finally:
        set_attention_metadata(None)


def _configure_inductor_cache(cache_dir: str | None) -> None:
    """Inductor's FX graph cache (generated C++ and its .so) under the Ladle cache dir."""
    apply_inductor_cache_dir(str(cache_root(cache_dir) / "inductor"))
    torch._inductor.config.fx_graph_cache = True


def _median_step(
    forward: Forward, scratch_block: int, block_size: int, local: int | None, repeats: int = 7
) -> float:
    return statistics.median(
        run_with_metadata(forward, 1, True, scratch_block, block_size, local)
        for _ in range(repeats)
    )


def _warm_up(
    model: nn.Module,
    scratch_block: int,
    block_size: int,
    thread_counts: list[int] | None,
    local: int | None,
) -> None:
    """Compile every graph a step can need: T = 1 (specialised), then T >= 2 (a prefill and
    a decode batch), at each thread count steps will use (Dynamo guards on it)."""
    previous = torch.get_num_threads()
    try:
        for threads in thread_counts or [previous]:
            torch.set_num_threads(threads)
            for num_tokens, is_decode in ((1, True), (2, False), (3, True)):
                run_with_metadata(model, num_tokens, is_decode, scratch_block, block_size, local)
    finally:
        torch.set_num_threads(previous)


@torch.inference_mode()
def compile_forward(
    model: nn.Module,
    mode: CompileMode,
    scratch_block: int,
    block_size: int,
    cache_dir: str | None = None,
    thread_counts: list[int] | None = None,
    local_scratch_block: int | None = None,
) -> CompiledForward | None:
    """The model with compiled decoder layers, warmed up at T = 1 and T >= 2; None: eager.

    Regional compilation: every decoder layer runs the same code, so Dynamo traces and
    inductor compiles one layer (per shape class) and all layers reuse it, a fraction of
    the time the whole model takes to compile. None when
    `mode` is off, on a non-CPU device (CUDA has its graphs), when compiling fails (logged),
    or in `auto` when the compiled single-token step measures slower than eager.
    """
    device = next(model.parameters()).device
    layers = decoder_layers(model)
    if mode == "off" or device.type != "cpu" or not layers:
        return None
    _configure_inductor_cache(cache_dir)
    started = time.perf_counter()
    forward = CompiledForward(model)
    try:
        for layer in layers:
            layer.compile(dynamic=True, fullgraph=True)
        _warm_up(model, scratch_block, block_size, thread_counts, local_scratch_block)
    except Exception as exc:
        logger.error("torch.compile of the decoder layers failed, running eagerly: %r", exc)
        _uncompile(layers)
        return None
    seconds = time.perf_counter() - started
    compiled_s = _median_step(forward, scratch_block, block_size, local_scratch_block)
    with torch.compiler.set_stance("force_eager"):
        eager_s = _median_step(model, scratch_block, block_size, local_scratch_block)
    keep = mode == "on" or compiled_s < eager_s
    logger.info(
        "compiled forward ready in %.1f s; one-token step %.1f ms compiled vs %.1f ms eager: %s",
        seconds,
        compiled_s * 1000,
        eager_s * 1000,
        "compiled" if keep else "eager (faster here)",
    )
    if not keep:
        _uncompile(layers)
    return forward if keep else None

"""Checkpoint tensors (HF names) into a model's parameters, fused projections included."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from worker.layers.linear import PackedLinear
from worker.layers.quant import QuantizedTensor
from worker.models.errors import ModelConfigError

# checkpoint name fragment -> (fused module name fragment, shard index)
PACKED_WEIGHTS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}

Weights = Iterable[tuple[str, torch.Tensor | QuantizedTensor]]


class MissingWeightsError(ModelConfigError):
    """A checkpoint without some of the model's weights."""


def packed_target(
    name: str, packed_map: dict[str, tuple[str, int]] = PACKED_WEIGHTS
) -> tuple[str, int] | None:
    """(fused parameter name, shard) for a checkpoint's q/k/v or gate/up tensor."""
    for fragment, (packed, shard) in packed_map.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed}."), shard
    return None


def load_checkpoint(
    model: nn.Module,
    weights: Weights,
    rename: Callable[[str], str | None] = lambda name: name,
    packed_map: dict[str, tuple[str, int]] = PACKED_WEIGHTS,
) -> set[str]:
    """Copy checkpoint tensors into `model`; returns the names loaded (`name#shard` for a
    shard of a fused projection). `rename` maps a checkpoint name onto the model's (None:
    skip it). A `QuantizedTensor` goes to its layer, which packs it at `quantize_linears`.
    Raises `ModelConfigError` for an unknown tensor, `MissingWeightsError` for missing ones."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        name = rename(checkpoint_name)
        if name is None or "rotary_emb.inv_freq" in name:
            continue
        target = packed_target(name, packed_map)
        if target is not None:
            packed_name, shard = target
            module = model.get_submodule(packed_name.rsplit(".", 1)[0])
            module.load_shard(params[packed_name], shard, tensor)
            loaded.add(f"{packed_name}#{shard}")
            continue
        if name not in params:
            raise ModelConfigError(f"unexpected weight {checkpoint_name!r} in checkpoint")
        if not isinstance(tensor, QuantizedTensor) and params[name].shape != tensor.shape:
            raise ModelConfigError(
                f"weight {checkpoint_name!r} is {tuple(tensor.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(tensor, QuantizedTensor):
            module.load_quantized(0, tensor)
        else:
            params[name].data.copy_(tensor)
        loaded.add(name)
        if isinstance(module, PackedLinear):  # a checkpoint that fuses them too (Phi-3)
            loaded.update(f"{name}#{i}" for i in range(len(module.shard_sizes)))
    check_complete(model, params, loaded)
    return loaded


def check_complete(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, PackedLinear):
            shards = [f"{name}#{i}" for i in range(len(module.shard_sizes))]
            missing += [s for s in shards if s not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise MissingWeightsError(f"checkpoint is missing weights: {', '.join(missing[:8])}{more}")

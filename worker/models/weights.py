"""Copying checkpoint tensors into a model whose projections may be fused (`PackedLinear`).

One loader for the model families that keep HF names apart from their fused projections:
a checkpoint name is first renamed (prefixes, old spellings), then either copied into its
parameter or into its shard's rows of a fused one; every parameter must be loaded once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from worker.layers.linear import PackedLinear

# checkpoint name fragment -> (fused name fragment, shard index)
PackedMap = dict[str, tuple[str, int]]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    packed: PackedMap,
    rename: Callable[[str], str | None],
) -> set[str]:
    """Copy `weights` into `model`; `rename` maps a checkpoint name to ours (None: skip it).

    Raises ValueError on a name the model has no place for, or a parameter left unloaded.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for raw_name, tensor in weights:
        name = rename(raw_name)
        if name is None:
            continue
        target = _packed_target(name, packed)
        if target is not None:
            packed_name, shard = target
            module = model.get_submodule(packed_name.rsplit(".", 1)[0])
            if packed_name not in params or not isinstance(module, PackedLinear):
                raise ValueError(f"unexpected weight {raw_name!r} in checkpoint")
            module.load_shard(params[packed_name], shard, tensor)
            loaded.add(f"{packed_name}#{shard}")
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {raw_name!r} in checkpoint")
        if params[name].shape != tensor.shape:
            raise ValueError(
                f"weight {raw_name!r} is {tuple(tensor.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        params[name].data.copy_(tensor)
        loaded.add(name)
    check_complete(model, params, loaded)
    return loaded


def check_complete(model: nn.Module, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    """Raise ValueError naming the parameters (or fused shards) no checkpoint tensor filled."""
    missing = []
    for name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(module, PackedLinear):
            shards = [f"{name}#{i}" for i in range(len(module.shard_sizes))]
            missing += [s for s in shards if s not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")


def _packed_target(name: str, packed: PackedMap) -> tuple[str, int] | None:
    for fragment, (fused, shard) in packed.items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{fused}."), shard
    return None

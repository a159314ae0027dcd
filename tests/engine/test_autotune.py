"""Kernels chosen by measurement: the plan's shape, its cache, the override, the dispatch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.engines import cpu_only
from tests.support.tiny_models import tiny_model_dir
from worker.engine import autotune
from worker.engine.autotune import (
    KernelPlan,
    buckets_for,
    choose_kernels,
    linear_groups,
    plan_cache_path,
)
from worker.layers.linear import Linear
from worker.layers.linear_kernels import BucketedKernel, build_kernel, kernel_names, linear_op
from worker.models.loader import load_model

pytestmark = cpu_only


@pytest.fixture(autouse=True)
def _restore_threads():
    previous = torch.get_num_threads()
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def model(tmp_path):
    path = tiny_model_dir("qwen2", tmp_path)  # qkv bias: kernels with and without bias
    return load_model(str(path), dtype="bfloat16", device="cpu").model


def _outputs(model: torch.nn.Module, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(rows)
    results = []
    for module in model.modules():
        if isinstance(module, Linear):
            x = torch.randn(rows, module.in_features).to(module.weight.dtype)
            bias = None if module.bias is None else module.bias.float()
            results.append((module(x), F.linear(x.float(), module.weight.float(), bias)))
    return results


def test_measured_plan_covers_every_group_and_bucket(model, tmp_path) -> None:
    plan = choose_kernels(model, "auto", max_num_seqs=4, max_threads=2, cache_dir=str(tmp_path))
    buckets = [str(b) for b in buckets_for(4)]
    assert buckets == ["1", "4", "256"]
    assert set(plan.kernels) == set(linear_groups(model))
    for choice in plan.kernels.values():
        assert sorted(choice, key=int) == buckets and set(choice.values()) <= set(kernel_names())
    assert set(plan.threads) == {"1", "4"} and set(plan.threads.values()) <= {1, 2}
    assert plan.source == "measured" and plan.summary()["1"].count("=") == len(plan.kernels) + 1
    for rows in (1, 3, 300):  # every bucket's kernel computes the same product
        for got, want in _outputs(model, rows):
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_plan_is_cached_per_machine_and_model(model, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (0.2, 0.2, 0.2))  # an idle machine
    first = choose_kernels(model, "auto", max_num_seqs=4, max_threads=1, cache_dir=str(tmp_path))
    path = plan_cache_path(model, buckets_for(4), 1, str(tmp_path))
    assert path.exists()
    again = choose_kernels(model, "auto", max_num_seqs=4, max_threads=1, cache_dir=str(tmp_path))
    assert again.source == "cache"
    assert (again.kernels, again.threads) == (first.kernels, first.threads)
    assert plan_cache_path(model, buckets_for(4), 2, str(tmp_path)) != path
    # a plan naming native kernels must not serve a process without them, nor the reverse
    flipped = not autotune.native.loaded()
    monkeypatch.setattr(autotune.native, "loaded", lambda: flipped)
    assert plan_cache_path(model, buckets_for(4), 1, str(tmp_path)) != path


def test_plan_timed_under_load_is_used_but_not_cached(model, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (3.5, 3.0, 2.0))  # busy 2 cores
    plan = choose_kernels(model, "auto", max_num_seqs=4, max_threads=2, cache_dir=str(tmp_path))
    assert plan.source == "measured" and plan.load == 3.5
    assert not plan_cache_path(model, buckets_for(4), 2, str(tmp_path)).exists()
    monkeypatch.setattr(autotune.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    again = choose_kernels(model, "auto", max_num_seqs=4, max_threads=2, cache_dir=str(tmp_path))
    assert again.source == "measured"  # timed again, and now kept
    assert plan_cache_path(model, buckets_for(4), 2, str(tmp_path)).exists()


def test_setting_overrides_the_measurement(model, tmp_path) -> None:
    plan = choose_kernels(model, "plain", max_num_seqs=4, max_threads=1, cache_dir=str(tmp_path))
    assert plan.source == "setting" and plan.threads == {}
    assert {n for c in plan.kernels.values() for n in c.values()} == {"plain"}
    assert all(m.kernel.name == "plain" for m in model.modules() if isinstance(m, Linear))
    assert not (tmp_path / "kernels").exists()
    with pytest.raises(ValueError, match="unknown linear kernel"):
        choose_kernels(model, "fastest", max_num_seqs=4, max_threads=1)


def test_threads_for_picks_the_bucket() -> None:
    plan = KernelPlan(kernels={}, threads={"1": 1, "4": 2, "16": 1})
    assert [plan.threads_for(r) for r in (1, 2, 4, 5, 16, 40)] == [1, 2, 2, 1, 1, 1]
    assert KernelPlan(kernels={}).threads_for(3) is None


def test_bucketed_kernel_dispatches_by_rows_and_through_the_custom_op() -> None:
    layer = Linear(8, 6, bias=True)
    calls = []

    class Named:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            calls.append((self.name, x.shape[0]))
            return F.linear(x, layer.weight, layer.bias)

    layer.set_kernel(BucketedKernel([(4, Named("big")), (1, Named("one"))]))
    assert layer.kernel.name == "1:one/4:big"
    for rows in (1, 3, 9):
        x = torch.randn(rows, 8)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert calls == [("one", 1), ("big", 3), ("big", 9)]
    x = torch.randn(2, 8)
    assert torch.equal(linear_op(x, layer.kernel_id, 6), layer(x))
    assert build_kernel("plain", layer.weight, None) is not None

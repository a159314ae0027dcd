"""Imports run one way: api -> shared; worker -> worker.engine -> worker.models ->
worker.layers; shared imports nothing of ours; the scheduler side never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("api", "worker", "shared")


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def offenders(package: str, forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in modules(package):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [
        ("shared", ("api", "worker", "torch")),
        ("api", ("worker", "torch")),
        ("worker/layers", ("worker.engine", "worker.models", "api", "redis", "fastapi")),
        ("worker/models", ("worker.engine", "api", "redis", "fastapi")),
        (
            "worker/engine",
            (
                "worker.main",
                "worker.service",
                "worker.store",
                "worker.heartbeat",
                "worker.job_state",
                "worker.metrics",
                "worker.engine_thread",
                "api",
                "redis",
                "arq",
                "fastapi",
            ),
        ),
    ],
)
def test_imports_run_one_way(package: str, forbidden: tuple[str, ...]) -> None:
    assert offenders(package, forbidden) == []


@pytest.mark.parametrize(
    "name",
    ["scheduler", "block_manager", "request", "outputs", "sampling_params", "config"],
)
def test_bookkeeping_never_imports_torch(name: str) -> None:
    path = ROOT / "worker" / "engine" / f"{name}.py"
    assert not {n for n in imports_of(path) if n.split(".")[0] == "torch"}


def test_the_model_runner_never_sees_http_redis_or_the_tokenizer() -> None:
    names = imports_of(ROOT / "worker" / "engine" / "model_runner.py")
    assert not {
        n
        for n in names
        if n.split(".")[0] in ("redis", "arq", "fastapi") or n == "shared.tokenizer"
    }

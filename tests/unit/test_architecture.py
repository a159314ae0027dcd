"""Imports run one way, stated as rules by package so a new file is covered by itself:
`shared` imports nothing of ours; `api` never imports `worker` or torch; nothing under
`worker/engine`, `worker/models` or `worker/layers` imports another `worker` module (the
engine may use models and layers, models may use layers, layers nothing of the worker);
the scheduler side never imports torch; the model runner never sees HTTP, Redis or the
tokenizer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("api", "worker", "shared", "ladle")
ENGINE_PACKAGES = ("worker.engine", "worker.models", "worker.layers")
SERVICES = ("redis", "arq", "fastapi", "starlette", "uvicorn")


def imports_of(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def offenders(package: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """Imports from `package` of anything in `forbidden` that `allowed` does not cover."""
    found = []
    for path in modules(package):
        for name in imports_of(path):
            if _within(name, forbidden) and not _within(name, allowed):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return found


# (package, what it may import of ours, what it must never import)
RULES = [
    ("shared", ("shared",), (*OURS, "torch")),
    ("ladle", ("ladle", "shared"), (*OURS, "torch")),
    ("api", ("api", "shared"), (*OURS, "torch")),
    ("worker.layers", ("worker.layers", "shared"), (*OURS, *SERVICES)),
    ("worker.models", ("worker.models", "worker.layers", "shared"), (*OURS, *SERVICES)),
    ("worker.engine", (*ENGINE_PACKAGES, "shared"), (*OURS, *SERVICES)),
    ("worker", ("worker", "shared"), ("api",)),
]


@pytest.mark.parametrize(("package", "allowed", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_imports_run_one_way(
    package: str, allowed: tuple[str, ...], forbidden: tuple[str, ...]
) -> None:
    assert offenders(package, allowed, forbidden) == []


def test_every_package_is_under_a_rule() -> None:
    """A new package of ours must get a rule (or be under one) before it can hold code."""
    covered = {ROOT / r[0].replace(".", "/") for r in RULES}
    for path in (p for top in OURS for p in (ROOT / top).rglob("__init__.py")):
        assert any(path.parent == c or c in path.parents for c in covered), path


def test_a_rule_catches_a_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules are by package: a file nobody listed is checked like the others."""
    engine = tmp_path / "worker" / "engine"
    engine.mkdir(parents=True)
    (engine / "brand_new.py").write_text("import worker.publisher\nimport redis\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    rule = next(r for r in RULES if r[0] == "worker.engine")
    assert sorted(offenders(*rule)) == [
        "worker/engine/brand_new.py imports redis",
        "worker/engine/brand_new.py imports worker.publisher",
    ]


BOOKKEEPING = ("scheduler", "block_manager", "request", "outputs", "sampling_params", "config")


@pytest.mark.parametrize("name", BOOKKEEPING)
def test_bookkeeping_never_imports_torch(name: str) -> None:
    path = ROOT / "worker" / "engine" / f"{name}.py"
    assert not {n for n in imports_of(path) if n.split(".")[0] == "torch"}


def test_the_model_runner_never_sees_http_redis_or_the_tokenizer() -> None:
    names = imports_of(ROOT / "worker" / "engine" / "model_runner.py")
    assert not {n for n in names if n.split(".")[0] in SERVICES or n == "shared.tokenizer"}

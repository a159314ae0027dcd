"""Imports run one way, stated as rules by package so a new file is covered by itself:
`shared` imports nothing of ours and holds only what both `api` and `worker` import; `ladle`
(the operator's commands) uses `shared` only; `api` never imports `worker` or torch, and its
feature folders import each other only as listed; nothing under `worker/engine`,
`worker/models` or `worker/layers` imports another `worker` module; the engine's core never
imports torch; the model runner never sees HTTP, Redis or the tokenizer; `loadtest` takes
test support from `tests.support` only, and nothing imports a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("api", "worker", "shared", "ladle")
ENGINE_PACKAGES = ("worker.engine", "worker.models", "worker.layers")
SERVICES = ("redis", "arq", "fastapi", "starlette", "uvicorn")
# The HTTP plumbing at api/'s root that every feature folder may use.
API_ROOT = ("api.errors", "api.auth", "api.services")


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, with `from pkg import mod` counted as `pkg.mod` too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
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
    return sorted(set(found))


# (package, what it may import of ours, what it must never import)
RULES = [
    ("shared", ("shared",), (*OURS, "torch")),
    ("ladle", ("ladle", "shared"), (*OURS, "torch")),
    ("api", ("api", "shared"), (*OURS, "torch")),
    ("api.keys", ("api.keys", "api.errors", "shared"), OURS),
    ("api.openai", ("api.openai", "api.jobs", *API_ROOT, "shared"), OURS),
    ("api.jobs", ("api.jobs", "api.openai", "api.keys", *API_ROOT, "shared"), OURS),
    ("api.batches", ("api.batches", "api.openai", "api.jobs", *API_ROOT, "shared"), OURS),
    ("api.ops", ("api.ops", "api.jobs", *API_ROOT, "shared"), OURS),
    ("worker.layers", ("worker.layers", "shared"), (*OURS, *SERVICES)),
    ("worker.models", ("worker.models", "worker.layers", "shared"), (*OURS, *SERVICES)),
    ("worker.engine", (*ENGINE_PACKAGES, "shared"), (*OURS, *SERVICES)),
    ("worker.engine.core", ("worker.engine.core", "shared"), (*OURS, *SERVICES, "torch")),
    ("worker", ("worker", "shared"), ("api", "ladle")),
    ("loadtest", (*OURS, "loadtest", "tests.support"), ("tests",)),
    ("tests.support", (*OURS, "tests.support"), ("tests", "loadtest")),
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


def test_every_api_folder_has_its_own_rule() -> None:
    """A feature folder under api/ states which other folders it may use."""
    folders = {p.parent.name for p in (ROOT / "api").glob("*/__init__.py")}
    assert folders == {r[0].removeprefix("api.") for r in RULES if r[0].startswith("api.")}


def _shared_reached_from(top: str) -> set[str]:
    """The shared modules `top` imports, directly or through other shared modules."""
    shared = {p.stem for p in (ROOT / "shared").glob("*.py")} - {"__init__"}
    names = {n for path in modules(top) for n in imports_of(path)}
    reached = {n.split(".")[1] for n in names if n.startswith("shared.")} & shared
    todo = list(reached)
    while todo:
        for name in imports_of(ROOT / "shared" / f"{todo.pop()}.py"):
            stem = name.split(".")[1] if name.startswith("shared.") else None
            if stem in shared and stem not in reached:
                reached.add(stem)
                todo.append(stem)
    return reached


def test_shared_holds_only_what_api_and_worker_both_import() -> None:
    """What only one side uses belongs to that side (api/, worker/ or ladle/)."""
    shared = {p.stem for p in (ROOT / "shared").glob("*.py")} - {"__init__"}
    assert shared - _shared_reached_from("api") == set(), "not imported by the API"
    assert shared - _shared_reached_from("worker") == set(), "not imported by the worker"


def test_nothing_imports_a_conftest() -> None:
    """Fixtures stay in conftest files; what tests share is in tests.support."""
    found = {
        str(path.relative_to(ROOT))
        for top in ("tests", "loadtest", *OURS)
        for path in modules(top)
        if any(name.endswith(".conftest") for name in imports_of(path))
    }
    assert found == set()


def test_a_rule_catches_a_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules are by package: a file nobody listed is checked like the others."""
    core = tmp_path / "worker" / "engine" / "core"
    core.mkdir(parents=True)
    (core / "brand_new.py").write_text("import torch\nfrom worker.engine import sampler\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", tmp_path)
    rule = next(r for r in RULES if r[0] == "worker.engine.core")
    assert offenders(*rule) == [
        "worker/engine/core/brand_new.py imports torch",
        "worker/engine/core/brand_new.py imports worker.engine",
        "worker/engine/core/brand_new.py imports worker.engine.sampler",
    ]


def test_the_model_runner_never_sees_http_redis_or_the_tokenizer() -> None:
    names = imports_of(ROOT / "worker" / "engine" / "model_runner.py")
    assert not {n for n in names if n.split(".")[0] in SERVICES or n.startswith("shared.tokenizer")}

"""Settings flow one way: `Settings` -> `EngineConfig`, with no second set of defaults."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from shared.config import (
    JEMALLOC_CONF,
    OPENMP_SPIN_DEFAULTS,
    Settings,
    active_allocator,
    allocator_env,
    allocator_library,
    apply_openmp_defaults,
    openmp_settings,
    preload_allocator,
)
from worker.engine.config import SETTING_NAMES, EngineConfig
from worker.engine.core.scheduler import SchedulerConfig

ROOT = Path(__file__).resolve().parents[2]


def _setting_name(name: str) -> str:
    return SETTING_NAMES.get(name, name)


def test_every_engine_field_is_a_setting_with_the_same_default() -> None:
    defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        info = Settings.model_fields[_setting_name(f.name)]
        assert getattr(defaults, f.name) == info.get_default(call_default_factory=True), f.name


def test_from_settings_copies_every_field() -> None:
    settings = Settings(
        model_name="/models/x",
        max_batch_size=7,
        block_size=32,
        kv_cache_size_mb=99,
        num_threads=3,
        cuda_graphs=False,
        enable_prefix_caching=False,
        cache_dir="/tmp/c",
    )
    config = EngineConfig.from_settings(settings)
    for f in dataclasses.fields(EngineConfig):
        assert getattr(config, f.name) == getattr(settings, _setting_name(f.name)), f.name
    assert (config.model, config.max_num_seqs, config.block_size) == ("/models/x", 7, 32)


def test_the_scheduler_has_no_defaults_of_its_own_for_engine_settings() -> None:
    required = {
        f.name for f in dataclasses.fields(SchedulerConfig) if f.default is dataclasses.MISSING
    }
    assert {"max_num_seqs", "max_num_batched_tokens", "max_model_len"} <= required


def _environment_users(path: Path) -> list[str]:
    """`os.environ` / `os.getenv` / `os.putenv` uses in a file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
            if isinstance(node.value, ast.Name) and node.value.id == "os":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


# Where the environment may be read or written: settings, and the supervisor, which hands
# its own environment to the processes it starts.
ENVIRONMENT_ALLOWED = {"shared/config.py", "ladle/launcher.py"}


def test_no_environment_reads_or_writes_outside_settings() -> None:
    found = [
        use
        for top in ("api", "worker", "shared", "ladle")
        for path in sorted((ROOT / top).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in ENVIRONMENT_ALLOWED
        for use in _environment_users(path)
    ]
    assert found == []


def test_openmp_defaults_bound_the_spin_unless_the_operator_chose_a_policy(monkeypatch) -> None:
    for name in ("OMP_WAIT_POLICY", *OPENMP_SPIN_DEFAULTS):
        monkeypatch.delenv(name, raising=False)
    apply_openmp_defaults()
    assert {k: openmp_settings()[k] for k in OPENMP_SPIN_DEFAULTS} == OPENMP_SPIN_DEFAULTS
    assert openmp_settings()["OMP_WAIT_POLICY"] is None

    monkeypatch.setenv("GOMP_SPINCOUNT", "5")  # an operator's own value stays
    apply_openmp_defaults()
    assert openmp_settings()["GOMP_SPINCOUNT"] == "5"

    for name in OPENMP_SPIN_DEFAULTS:
        monkeypatch.delenv(name)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # a chosen policy: nothing added
    apply_openmp_defaults()
    assert openmp_settings() == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": None,
        "KMP_BLOCKTIME": None,
    }


def test_the_allocator_setting(monkeypatch) -> None:
    import ctypes.util

    found = {"jemalloc": None, "tcmalloc_minimal": "libtcmalloc_minimal.so.4", "tcmalloc": None}
    monkeypatch.setattr(ctypes.util, "find_library", found.get)
    assert allocator_library("auto") == "libtcmalloc_minimal.so.4"  # the first one installed
    assert allocator_library("system") is None
    assert allocator_library("/opt/lib/libmimalloc.so") == "/opt/lib/libmimalloc.so"
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    assert allocator_library("auto") is None  # none installed: glibc's malloc


def test_allocator_env_sets_jemallocs_options_unless_the_operator_did() -> None:
    jemalloc = "/usr/lib/libjemalloc.so.2"
    env = allocator_env({"PATH": "/bin"}, jemalloc)
    assert env == {"PATH": "/bin", "LD_PRELOAD": jemalloc, "MALLOC_CONF": JEMALLOC_CONF}
    assert allocator_env(env, jemalloc) == env  # preloaded already: as it was
    mine = {"LD_PRELOAD": jemalloc, "MALLOC_CONF": "narenas:2"}
    assert allocator_env(mine, jemalloc) == mine
    tcmalloc = allocator_env({}, "/usr/lib/libtcmalloc_minimal.so.4")
    assert "MALLOC_CONF" not in tcmalloc  # jemalloc's options only
    assert allocator_env({"PATH": "/bin"}, "system") == {"PATH": "/bin"}


def test_preload_allocator_reexecs_once_with_the_library(monkeypatch) -> None:
    import os

    calls = []
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append(env["LD_PRELOAD"]))
    monkeypatch.setenv("LLM_MALLOC", "/opt/lib/libjemalloc.so.2")
    monkeypatch.setenv("LD_PRELOAD", "/opt/lib/other.so")
    preload_allocator()
    assert calls == ["/opt/lib/libjemalloc.so.2:/opt/lib/other.so"]
    monkeypatch.setenv("LD_PRELOAD", calls[0])  # what the re-exec'd process sees
    monkeypatch.setenv("MALLOC_CONF", JEMALLOC_CONF)
    preload_allocator()
    assert len(calls) == 1  # already preloaded: no second exec
    assert active_allocator() == (
        f"/opt/lib/libjemalloc.so.2 (preloaded, MALLOC_CONF={JEMALLOC_CONF})"
    )
    monkeypatch.setenv("LLM_MALLOC", "system")
    monkeypatch.delenv("LD_PRELOAD")
    preload_allocator()
    assert len(calls) == 1 and active_allocator() == "glibc malloc"

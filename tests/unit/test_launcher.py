"""`ladle` CLI parsing, the broker's order of choice, child specs and the supervisor."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from ladle import broker, cli, launcher
from ladle.broker import BrokerError, BrokerHandle
from shared.config import Settings

ROOT = Path(__file__).resolve().parents[2]

# ---- argument parsing -------------------------------------------------------------------------


def test_up_defaults() -> None:
    opts = cli.options_from_args(cli.build_parser().parse_args(["up"]))
    assert opts == launcher.UpOptions(num_workers=1, ready_timeout_s=600.0)


def test_up_flags() -> None:
    args = cli.build_parser().parse_args(
        [
            "up",
            "--workers",
            "3",
            "--port",
            "9000",
            "--model",
            "/m/x.gguf",
            "--host",
            "0.0.0.0",
            "--redis-url",
            "redis://r:1/2",
            "--no-start-redis",
            "--ready-timeout",
            "5",
            "--shutdown-timeout",
            "7",
        ]
    )
    assert cli.options_from_args(args) == launcher.UpOptions(
        num_workers=3,
        host="0.0.0.0",
        port=9000,
        model="/m/x.gguf",
        redis_url="redis://r:1/2",
        start_redis=False,
        ready_timeout_s=5.0,
        shutdown_timeout_s=7.0,
    )


@pytest.mark.parametrize("argv", [[], ["up", "--workers", "0"], ["up", "--port", "x"], ["nope"]])
def test_bad_arguments_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(argv)
    assert exc.value.code == 2


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    for name in ("up", "api", "worker", "generate"):
        assert name in out


@pytest.mark.parametrize(
    ("argv", "module", "rest"),
    [
        (["api", "--help"], "api", ["--help"]),
        (
            ["worker", "--model", "m", "--worker-id", "w"],
            "worker",
            ["--model", "m", "--worker-id", "w"],
        ),
        (["generate", "--prompt", "hi"], "worker.engine.cli", ["--prompt", "hi"]),
    ],
)
def test_passthrough_execs_the_module(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], module: str, rest: list[str]
) -> None:
    calls = []

    def fake_exec(mod: str, args: list[str]) -> None:
        calls.append((mod, args))
        raise SystemExit(0)

    monkeypatch.setattr(cli, "exec_module", fake_exec)
    with pytest.raises(SystemExit):
        cli.main(argv)
    assert calls == [(module, rest)]


# ---- broker order of choice -------------------------------------------------------------------


@pytest.fixture
def broker_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []

    def private(binary: str) -> BrokerHandle:
        calls.append(f"private:{binary}")
        return BrokerHandle("redis://127.0.0.1:1/0", "private-redis-server")

    def embedded() -> BrokerHandle:
        calls.append("embedded")
        return BrokerHandle("redis://127.0.0.1:2/0", "embedded")

    monkeypatch.setattr(broker, "start_private_redis", private)
    monkeypatch.setattr(broker, "start_embedded_broker", embedded)
    return calls


def test_configured_redis_first(monkeypatch: pytest.MonkeyPatch, broker_calls: list[str]) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: True)
    monkeypatch.setattr(broker, "redis_server_binary", lambda: "/usr/bin/redis-server")
    handle = broker.find_or_start_redis("redis://h:6379/3")
    assert (handle.url, handle.kind, broker_calls) == ("redis://h:6379/3", "configured", [])


def test_private_redis_second(monkeypatch: pytest.MonkeyPatch, broker_calls: list[str]) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: False)
    monkeypatch.setattr(broker, "redis_server_binary", lambda: "/opt/redis-server")
    handle = broker.find_or_start_redis("redis://h:6379/0")
    assert handle.kind == "private-redis-server"
    assert broker_calls == ["private:/opt/redis-server"]


def test_embedded_last(
    monkeypatch: pytest.MonkeyPatch, broker_calls: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: False)
    monkeypatch.setattr(broker, "redis_server_binary", lambda: None)
    handle = broker.find_or_start_redis("redis://h:6379/0")
    assert (handle.kind, broker_calls) == ("embedded", ["embedded"])
    assert "NOT for production" in caplog.text


def test_no_start_fails(monkeypatch: pytest.MonkeyPatch, broker_calls: list[str]) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: False)
    with pytest.raises(BrokerError):
        broker.find_or_start_redis("redis://:secret@h:6379/0", allow_start=False)
    assert broker_calls == []


def test_a_url_the_user_set_is_never_replaced(
    monkeypatch: pytest.MonkeyPatch, broker_calls: list[str]
) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: False)
    monkeypatch.setattr(broker, "redis_server_binary", lambda: "/usr/bin/redis-server")
    sentinel = "redis+sentinel://127.0.0.1:26390,127.0.0.1:26391/mymaster/0"
    with pytest.raises(BrokerError, match="nothing answers at LLM_REDIS_URL=redis\\+sentinel"):
        broker.find_or_start_redis(sentinel, is_default=False)
    with pytest.raises(BrokerError, match="unknown scheme 'redis\\+sentinal'"):
        broker.find_or_start_redis("redis+sentinal://h:1/m", is_default=False)
    assert broker_calls == []  # nothing started in its place


def test_up_stops_with_one_line_for_a_set_url_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(broker, "ping", lambda url, timeout_s=1.0: False)
    monkeypatch.setenv("LLM_REDIS_URL", "redis+sentinel://127.0.0.1:26390/mymaster/0")
    monkeypatch.setattr(launcher, "setup_logging", lambda level: None)
    assert launcher.run_up(launcher.UpOptions()) == 1
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "nothing answers at LLM_REDIS_URL=redis+sentinel://127.0.0.1:26390" in line
    assert "\n" not in line


def test_safe_url_hides_credentials() -> None:
    assert broker.safe_url("redis://u:pw@h:1/0") == "redis://***@h:1/0"
    assert broker.safe_url("redis://h:1/0") == "redis://h:1/0"


def test_handle_stop_runs_once() -> None:
    calls = []
    handle = BrokerHandle("redis://x", "embedded", lambda: calls.append(1))
    handle.stop()
    handle.stop()
    assert calls == [1]


# ---- child specs ------------------------------------------------------------------------------


def test_child_specs_give_each_worker_its_id_and_port() -> None:
    settings = Settings(
        redis_url="redis://127.0.0.1:7777/0",
        port=8123,
        model_name="m.gguf",
        worker_metrics_port=9101,
    )
    specs = launcher.child_specs(settings, 3, {"PATH": "/bin"}, worker_id_base="box")
    assert [s.name for s in specs] == ["api", "worker-0", "worker-1", "worker-2"]
    assert specs[0].argv == [sys.executable, "-m", "api"]
    assert all(s.argv == [sys.executable, "-m", "worker"] for s in specs[1:])
    assert [s.env["LLM_WORKER_ID"] for s in specs[1:]] == ["box-0", "box-1", "box-2"]
    assert [s.env["LLM_WORKER_METRICS_PORT"] for s in specs[1:]] == ["9101", "9102", "9103"]
    for spec in specs:
        assert spec.env["LLM_REDIS_URL"] == "redis://127.0.0.1:7777/0"
        assert spec.env["LLM_PORT"] == "8123"
        assert spec.env["LLM_MODEL_NAME"] == "m.gguf"
        assert spec.env["PATH"] == "/bin"
    assert "LLM_WORKER_ID" not in specs[0].env


def test_workers_start_with_the_allocator_preloaded() -> None:
    settings = Settings(malloc="/lib/libtcmalloc.so")
    specs = launcher.child_specs(settings, 1, {"LD_PRELOAD": "/lib/other.so"}, "b")
    assert specs[1].env["LD_PRELOAD"] == "/lib/libtcmalloc.so:/lib/other.so"
    assert specs[0].env["LD_PRELOAD"] == "/lib/other.so"  # the API does not preload one
    system = launcher.child_specs(Settings(malloc="system"), 1, {}, "b")
    assert "LD_PRELOAD" not in system[1].env


def test_metrics_port_zero_stays_off_and_threads_are_shared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    specs = launcher.child_specs(Settings(worker_metrics_port=0), 2, {}, worker_id_base="b")
    assert [s.env["LLM_WORKER_METRICS_PORT"] for s in specs[1:]] == ["0", "0"]
    assert [s.env["LLM_NUM_THREADS"] for s in specs[1:]] == ["4", "4"]
    one = launcher.child_specs(Settings(), 1, {}, worker_id_base="b")
    assert "LLM_NUM_THREADS" not in one[1].env
    mine = launcher.child_specs(Settings(), 2, {"LLM_NUM_THREADS": "3"}, worker_id_base="b")
    assert mine[1].env["LLM_NUM_THREADS"] == "3"


def test_banner_and_client_url() -> None:
    settings = Settings(host="0.0.0.0", port=8001, model_name="SmolLM2-135M-Instruct")
    assert launcher.base_url(settings) == "http://127.0.0.1:8001"
    text = launcher.banner(settings)
    assert "http://127.0.0.1:8001/v1" in text
    assert "curl http://127.0.0.1:8001/v1/chat/completions" in text
    assert '"model": "SmolLM2-135M-Instruct"' in text
    assert "Authorization" not in text
    assert "Authorization" in launcher.banner(Settings(api_keys="k1"))


# ---- supervisor -------------------------------------------------------------------------------


def _py(name: str, code: str, env: dict[str, str] | None = None) -> launcher.ChildSpec:
    return launcher.ChildSpec(
        name, [sys.executable, "-c", textwrap.dedent(code)], env or dict(os.environ)
    )


SLEEPER = "import time; time.sleep(60)"
STUBBORN = """
    import pathlib, signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pathlib.Path({flag!r}).touch()
    time.sleep(60)
"""


def test_stop_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    flag = tmp_path / "ready"
    sup = launcher.Supervisor([_py("stubborn", STUBBORN.format(flag=str(flag)))])
    sup.start()
    deadline = time.monotonic() + 30
    while not flag.exists() and time.monotonic() < deadline:  # its SIGTERM handler is set
        time.sleep(0.02)
    sup.stop(0.3)
    assert sup.children[0].proc.returncode == -signal.SIGKILL


def test_describe_exit() -> None:
    assert launcher.describe_exit(3) == "code 3"
    assert launcher.describe_exit(-signal.SIGKILL) == "signal SIGKILL"


FAKE_API = """
    import http.server, os
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/ready" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer((os.environ["LLM_HOST"], int(os.environ["LLM_PORT"])),
                           H).serve_forever()
"""


def test_up_runs_until_sigterm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stopped = []
    monkeypatch.setenv("LLM_SUPERVISOR_METRICS_PORT", "0")
    monkeypatch.setattr(
        launcher,
        "find_or_start_redis",
        lambda url, allow_start, is_default: BrokerHandle(
            "redis://127.0.0.1:1/0", "embedded", lambda: stopped.append(True)
        ),
    )
    seen_specs: list[launcher.ChildSpec] = []
    real_specs = launcher.child_specs

    def specs(settings: Settings, num_workers: int, env: dict[str, str], **kw: object) -> list:
        real = real_specs(settings, num_workers, env, **kw)
        seen_specs.extend(real)
        return [_py("api", FAKE_API, real[0].env)] + [_py(s.name, SLEEPER, s.env) for s in real[1:]]

    monkeypatch.setattr(launcher, "child_specs", specs)

    def ready_then_stop(settings: Settings) -> str:
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM)).start()
        return "READY-BANNER"

    monkeypatch.setattr(launcher, "banner", ready_then_stop)
    opts = launcher.UpOptions(num_workers=2, port=broker.spare_port(), shutdown_timeout_s=10)
    assert launcher.run_up(opts) == 0
    assert "READY-BANNER" in capsys.readouterr().out
    assert stopped == [True]
    assert [s.env["LLM_REDIS_URL"] for s in seen_specs] == ["redis://127.0.0.1:1/0"] * 3


def test_python_dash_m_shared_cli_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ladle", "up", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    assert "--workers" in result.stdout and "embedded broker" in result.stdout


# ---- several models ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "group"),
    [
        ("m.gguf", launcher.WorkerGroup("m.gguf", 1)),
        ("/models/a:3", launcher.WorkerGroup("/models/a", 3)),
        ("fp32=SmolLM2-135M-Instruct:2", launcher.WorkerGroup("SmolLM2-135M-Instruct", 2, "fp32")),
        ("c:/x", launcher.WorkerGroup("c:/x", 1)),
    ],
)
def test_worker_group_parses(text: str, group: launcher.WorkerGroup) -> None:
    assert launcher.WorkerGroup.parse(text) == group


@pytest.mark.parametrize("text", ["m:0", "=m", ""])
def test_worker_group_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        launcher.WorkerGroup.parse(text)


def test_worker_groups_start_workers_per_model() -> None:
    groups = [launcher.WorkerGroup("a.gguf", 2), launcher.WorkerGroup("b", 1, "bee")]
    options = launcher.UpOptions(worker_groups=groups)
    settings = launcher.settings_for(options)
    assert settings.model_name == "a.gguf" and settings.model_id == "a"
    env = {"LLM_SERVED_MODEL_NAME": "ignored"}
    specs = launcher.child_specs(settings, 1, env, worker_id_base="b", groups=groups)
    assert [s.name for s in specs] == ["api", "worker-0", "worker-1", "worker-2"]
    assert [s.env["LLM_MODEL_NAME"] for s in specs] == ["a.gguf", "a.gguf", "a.gguf", "b"]
    assert [s.env.get("LLM_SERVED_MODEL_NAME") for s in specs[1:]] == [None, None, "bee"]
    assert [s.env["LLM_WORKER_ID"] for s in specs[1:]] == ["b-0", "b-1", "b-2"]
    args = cli.build_parser().parse_args(["up", "--worker", "a.gguf:2", "--worker", "bee=b"])
    assert cli.options_from_args(args).worker_groups == groups

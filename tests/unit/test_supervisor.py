"""`ladle up`'s supervisor: restart with backoff, crash-loop limit, status for `/ready`."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid

import pytest
import redis

from ladle import launcher
from ladle.supervisor import ChildSpec, RestartPolicy, StatusPublisher, Supervisor
from shared.contracts import SupervisorRecord
from shared.errors import EXIT_CONFIG_ERROR
from shared.keys import Keys
from tests.unit.api_harness import REDIS_URL, harness

SLEEPER = "import time; time.sleep(60)"
CRASHER = "raise SystemExit(3)"
FAST = RestartPolicy(backoff_s=0.05, backoff_max_s=0.4, max_crashes=3, window_s=60)


def _py(name: str, code: str) -> ChildSpec:
    return ChildSpec(name, [sys.executable, "-c", code], dict(os.environ))


def _until(check, timeout: float = 30.0, sup: Supervisor | None = None) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition never met"
        if sup is not None:
            sup.check()
        time.sleep(0.01)


def test_backoff_doubles_to_the_max_and_resets_after_a_long_run() -> None:
    policy = RestartPolicy()  # 1 s doubling to 30 s
    delays, delay = [], 0.0
    for _ in range(7):
        delay = policy.next_delay(delay, uptime_s=0.5)
        delays.append(delay)
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    assert policy.next_delay(30, uptime_s=30.0) == 1  # it ran long enough: start over


def test_a_crashing_child_is_restarted_then_given_up_while_the_rest_serve(
    caplog: pytest.LogCaptureFixture,
) -> None:
    restarted: list[str] = []
    sup = Supervisor([_py("api", SLEEPER), _py("worker-0", CRASHER)], FAST, restarted.append)
    caplog.set_level(logging.INFO, "ladle.supervisor")
    sup.start()
    api, worker = sup.children
    api_pid = api.proc.pid if api.proc else None
    try:
        _until(lambda: worker.state == "given_up", sup=sup)
        assert restarted == ["worker-0", "worker-0"]  # 3 runs, 3 crashes: the limit
        assert (worker.restarts, len(worker.crashes), worker.last_exit) == (2, 3, "code 3")
        assert worker.proc is None and not sup.all_given_up()
        assert api.is_alive() and api.proc is not None and api.proc.pid == api_pid
        status = {s.name: s for s in sup.statuses()}
        assert status["api"].state == "running" and status["api"].pid == api_pid
        assert status["worker-0"].state == "given_up" and status["worker-0"].pid is None
        assert "worker-0 exited 3 times within 60 s" in (status["worker-0"].message or "")
        assert "no longer restarted" in caplog.text
        assert caplog.text.count("restarting it in") == 2
    finally:
        sup.stop(5)
    assert api.proc is not None and api.proc.returncode == -signal.SIGTERM


def test_a_killed_child_comes_back_with_a_new_pid() -> None:
    sup = Supervisor([_py("worker-0", SLEEPER)], FAST)
    sup.start()
    (child,) = sup.children
    assert child.proc is not None
    first = child.proc.pid
    try:
        os.kill(first, signal.SIGKILL)
        _until(lambda: child.restarts == 1 and child.is_alive(), sup=sup)
        assert child.proc.pid != first and child.last_exit == "signal SIGKILL"
    finally:
        sup.stop(5)


def test_a_restart_due_after_stop_never_happens() -> None:
    slow = RestartPolicy(backoff_s=30, backoff_max_s=60, max_crashes=5, window_s=60)
    sup = Supervisor([_py("worker-0", CRASHER)], slow)
    sup.start()
    _until(lambda: sup.children[0].state == "restarting", sup=sup)
    sup.stop(1)
    sup.check()
    assert sup.children[0].state == "stopped" and not sup.any_alive()


def test_supervise_exits_1_only_when_everything_gave_up() -> None:
    sup = Supervisor([_py("api", CRASHER), _py("worker-0", CRASHER)], FAST)
    sup.start()
    with launcher.SignalLatch() as latch:
        code = launcher.supervise(sup, latch, "http://127.0.0.1:9/ready", 30, lambda: None, 0.01)
    assert code == 1 and sup.all_given_up()


def test_a_configuration_error_is_not_retried_and_stops_supervise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusing = _py("worker-0", f"raise SystemExit({EXIT_CONFIG_ERROR})")
    sup = Supervisor([_py("api", SLEEPER), refusing], FAST)
    caplog.set_level(logging.INFO)
    sup.start()
    try:
        with launcher.SignalLatch() as latch:
            code = launcher.supervise(
                sup, latch, "http://127.0.0.1:9/ready", 30, lambda: None, 0.01
            )
    finally:
        sup.stop(5)
    worker = sup.children[1]
    assert code == EXIT_CONFIG_ERROR and worker.restarts == 0 and worker.refused
    assert "refused its configuration" in (worker.message or "")
    assert any("stopping: worker-0" in r.getMessage() for r in caplog.records)


def test_supervise_runs_until_a_signal_through_crashes_and_a_readiness_timeout() -> None:
    sup = Supervisor([_py("api", SLEEPER), _py("worker-0", "import time; time.sleep(0.2)")])
    sup.start()
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    with launcher.SignalLatch() as latch:
        code = launcher.supervise(sup, latch, "http://127.0.0.1:9/ready", 0.1, lambda: None, 0.01)
    sup.stop(5)
    assert code == 0 and sup.children[1].restarts >= 1


async def test_ready_lists_the_processes_and_warns_about_a_given_up_child() -> None:
    async with harness() as h:
        keys = Keys(h.settings.key_prefix)
        sup = Supervisor([_py("api", SLEEPER), _py("worker-1", CRASHER)], FAST)
        sup.start()
        _until(lambda: sup.children[1].state == "given_up", sup=sup)
        publisher = StatusPublisher(REDIS_URL, keys)
        publisher.publish(sup.statuses())
        try:
            body = (await h.client.get("/ready")).json()
            stored = redis.Redis.from_url(REDIS_URL).get(keys.supervisor(publisher.supervisor_id))
        finally:
            sup.stop(5)
            publisher.remove()
        assert body["status"] == "ready"
        assert [(p["name"], p["state"]) for p in body["processes"]] == [
            ("api", "running"),
            ("worker-1", "given_up"),
        ]
        assert len(body["warnings"]) == 1 and "worker-1 exited 3 times" in body["warnings"][0]
        assert SupervisorRecord.model_validate_json(stored).children[1].restarts == 2
        assert (await h.client.get("/ready")).json().get("processes") is None  # record removed


def test_publisher_skips_updates_while_redis_is_away() -> None:
    publisher = StatusPublisher("redis://127.0.0.1:9/0", Keys(f"t-{uuid.uuid4().hex[:6]}"))
    started = time.monotonic()
    publisher.publish([], force=True)  # connection refused: logged at debug, not raised
    assert time.monotonic() - started < 2

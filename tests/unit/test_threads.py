"""The thread count per kind of step follows the steps' measured times (ThreadChooser)."""

from __future__ import annotations

from worker.engine.threads import ThreadChooser


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(chooser: ThreadChooser, clock: Clock, kind: str, cost: dict[int, float], steps: int):
    """`steps` steps of `kind`, each taking cost[threads] seconds; the counts used, in order."""
    used = []
    for _ in range(steps):
        threads = chooser.pick(kind)
        used.append(threads)
        clock.now += cost[threads]
        chooser.record(kind, threads, cost[threads])
    return used


def test_starts_on_the_plan_and_keeps_it_while_it_is_faster() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock)
    used = run(chooser, clock, "decode<=1", {1: 0.033, 2: 0.026}, 1000)
    assert used[0] == 2
    probes = used.count(1) / chooser.probe_steps
    assert 1 <= probes <= 6  # 26 s of steps: probes after 2, 4, 8, 16 s apart, never kept
    assert chooser.choices() == {"decode<=1": 2} and chooser.num_switches == 0


def test_switches_when_the_machine_changes_and_back_when_it_recovers() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock, max_probe_s=10.0)
    run(chooser, clock, "decode<=1", {1: 0.033, 2: 0.026}, 200)
    # another process takes a core: 2 threads now wait on each other at every barrier
    used = run(chooser, clock, "decode<=1", {1: 0.033, 2: 0.350}, 300)
    assert chooser.choices() == {"decode<=1": 1}
    probe = chooser.probe_steps
    assert used.count(2) <= 12 * probe  # the slow count is only probed, ever more rarely
    assert used[-100:].count(2) <= 2 * probe
    run(chooser, clock, "decode<=1", {1: 0.033, 2: 0.026}, 1000)  # the core is free again
    assert chooser.choices() == {"decode<=1": 2}
    assert chooser.num_switches == 2


def test_each_kind_of_step_chooses_on_its_own() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 4], lambda kind: 4 if kind == "prefill" else 1, clock=clock)
    for _ in range(400):
        for kind, cost in (("prefill", {1: 0.4, 4: 0.12}), ("decode<=16", {1: 0.05, 4: 0.03})):
            threads = chooser.pick(kind)
            clock.now += cost[threads]
            chooser.record(kind, threads, cost[threads])
    assert chooser.choices() == {"decode<=16": 4, "prefill": 4}


def test_one_slow_step_does_not_move_a_kind() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock)
    run(chooser, clock, "decode<=16", {1: 0.050, 2: 0.030}, 100)
    chooser.record("decode<=16", 2, 0.300)  # a step that met a garbage collection
    used = run(chooser, clock, "decode<=16", {1: 0.050, 2: 0.030}, 400)
    assert chooser.choices() == {"decode<=16": 2} and chooser.num_switches == 0
    assert used.count(1) <= 4 * chooser.probe_steps


def test_a_probe_is_judged_on_the_median_of_its_steps() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 1, clock=clock, probe_steps=3)
    run(chooser, clock, "decode<=16", {1: 0.050, 2: 0.030}, 30)  # 1.5 s: no probe yet
    while chooser.pick("decode<=16") == 1:
        clock.now += 0.050
        chooser.record("decode<=16", 1, 0.050)
    for seconds in (0.070, 0.030, 0.030):  # the first probe step wakes the other thread
        clock.now += seconds
        chooser.record("decode<=16", 2, seconds)
    assert chooser.choices() == {"decode<=16": 2}


def test_steps_of_seconds_are_probed_one_step_at_a_time() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock, probe_budget_s=0.2)
    used = run(chooser, clock, "prefill<=1024", {1: 2.4, 2: 1.2}, 100)  # 2 minutes of chunks
    assert chooser.choices() == {"prefill<=1024": 2}
    assert 1 <= used.count(1) <= 6  # probes 2, 4, 8, ... s apart, one step each
    assert all(a != 1 or b != 1 for a, b in zip(used, used[1:], strict=False))


def test_a_single_option_never_probes() -> None:
    clock = Clock()
    chooser = ThreadChooser([1], lambda kind: 2, clock=clock)  # the plan's 2 is not allowed
    assert set(run(chooser, clock, "decode<=1", {1: 0.03}, 500)) == {1}


def test_a_wrong_first_count_is_probed_within_a_few_steps() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 1, clock=clock, first_probe_after=4)
    used = run(chooser, clock, "decode<=16", {1: 0.038, 2: 0.026}, 20)
    assert used[:4] == [1, 1, 1, 1]  # then the probe, long before min_probe_s has passed
    assert clock.now < chooser.min_probe_s
    assert chooser.choices() == {"decode<=16": 2} and used[-6:] == [2] * 6


def waves(chooser: ThreadChooser, clock: Clock, kind: str, ratio: float, steps: int):
    """Batches that fill and drain: 8 dear steps, 8 cheap ones; 1 thread costs `ratio` x 2."""
    used = []
    for i in range(steps):
        threads = chooser.pick(kind)
        used.append(threads)
        seconds = (0.030 if (i // 8) % 2 == 0 else 0.018) * (ratio if threads == 1 else 1.0)
        clock.now += seconds
        chooser.record(kind, threads, seconds)
    return used


def test_a_probe_is_weighed_against_the_steps_between_its_own() -> None:
    # A probe that falls on cheap steps after dear ones would look faster against the
    # choice's older steps; against the steps paired with its own it does not.
    for first_probe_after in range(4, 20):
        clock = Clock()
        chooser = ThreadChooser(
            [1, 2], lambda kind: 2, clock=clock, first_probe_after=first_probe_after
        )
        waves(chooser, clock, "decode<=16", 1.15, 2000)
        assert chooser.num_switches == 0, first_probe_after


def test_a_near_tie_does_not_switch() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock, margin=0.05)
    run(chooser, clock, "decode<=1", {1: 0.0099, 2: 0.0100}, 2000)
    assert chooser.num_switches == 0


def test_long_steps_are_probed_for_a_small_share_of_their_time() -> None:
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock, probe_share=0.05)
    used = run(chooser, clock, "prefill<=1024", {1: 1.2, 2: 0.66}, 200)
    probe_time = used.count(1) * 1.2
    assert 1 <= used.count(1) and probe_time <= 0.05 * clock.now + 1.2  # the first probe
    assert chooser.choices() == {"prefill<=1024": 2}


def test_fewer_threads_need_a_clear_win_more_threads_a_small_one() -> None:
    # A step 10 % faster on one thread (the service's own bursts on the other core can fake
    # it) does not move a kind off two; a step 10 % faster on two moves a kind off one.
    clock = Clock()
    chooser = ThreadChooser([1, 2], lambda kind: 2, clock=clock, fewer_margin=0.25)
    run(chooser, clock, "decode<=16", {1: 0.027, 2: 0.030}, 2000)
    assert chooser.num_switches == 0
    chooser = ThreadChooser([1, 2], lambda kind: 1, clock=clock, fewer_margin=0.25)
    run(chooser, clock, "decode<=16", {1: 0.030, 2: 0.027}, 200)
    assert chooser.choices() == {"decode<=16": 2} and chooser.num_switches == 1

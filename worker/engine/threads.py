"""Threads per CPU step, chosen from the steps' own wall times while the engine runs.

Which thread count runs a step fastest depends on the machine and on its load, and both
change under a running worker. On 2 idle cores one sequence's decode step took 26-29 ms on
2 threads and 31-33 ms on 1; with another process taking a core (a build, a neighbour in the
same cgroup, a CPU quota below the core count) the 2-thread step took 350 ms, because each
OpenMP barrier waits for a thread that is not running (docs/benchmarks.md "Threads under
load"). A choice made once at start (the kernel plan's timing) is right for one of those
and badly wrong for the other.

So each kind of step (decode-only, by batch bucket; any step with prefill) keeps the wall times
of its recent steps per thread count, runs the count whose median is smaller, and now and then
runs a few steps on the other count (a probe) to see whether the answer changed. Medians, not
averages: one step that met a garbage collection or the API's burst of work would otherwise
move a kind to the slower count (seen in the service: a 2-thread average of 293 ms against
steps of 43 ms). A probe that confirms the choice doubles the wait before the next (up to
`max_probe_s`); a probe that overturns it switches at once and resets the wait. The start-up
plan only gives the first choice.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Kind:
    """One kind of step: its recent step times per thread count and when to probe next."""

    choice: int
    recent: dict[int, deque[float]] = field(default_factory=dict)
    probe_wait_s: float = 0.0
    next_probe_at: float = 0.0
    probing: int | None = None
    probe_left: int = 0

    def median(self, threads: int) -> float | None:
        times = self.recent.get(threads)
        return statistics.median(times) if times else None


class ThreadChooser:
    """`pick(kind)` before a step, `record(kind, threads, seconds)` after it."""

    def __init__(
        self,
        options: list[int],
        initial: Callable[[str], int],
        min_probe_s: float = 2.0,
        max_probe_s: float = 60.0,
        window: int = 8,
        probe_steps: int = 3,
        probe_budget_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = sorted(set(options))
        self._initial = initial
        self.min_probe_s = min_probe_s
        self.max_probe_s = max_probe_s
        self.window = window  # step times kept per thread count
        self.probe_steps = probe_steps  # steps per probe: its first may pay the team's wake-up
        # a probe of steps longer than this (a long prompt's chunks) is one step: where a
        # step takes a second, three on the slower count would cost seconds
        self.probe_budget_s = probe_budget_s
        self._clock = clock
        self._kinds: dict[str, _Kind] = {}
        self.num_switches = 0

    def pick(self, kind: str) -> int:
        """The thread count for the next step of this kind (now and then, a probe)."""
        state = self._kinds.get(kind)
        if state is None:
            first = self._initial(kind)
            state = self._kinds[kind] = _Kind(
                choice=first if first in self.options else self.options[-1],
                probe_wait_s=self.min_probe_s,
                next_probe_at=self._clock() + self.min_probe_s,
            )
        if state.probing is not None:
            return state.probing
        step = state.median(state.choice)
        if len(self.options) > 1 and step is not None:
            if self._clock() >= state.next_probe_at:
                state.probing = next(t for t in self.options if t != state.choice)
                state.probe_left = max(1, min(self.probe_steps, int(self.probe_budget_s / step)))
                state.recent.pop(state.probing, None)  # the probe's own steps only
                return state.probing
        return state.choice

    def record(self, kind: str, threads: int, seconds: float) -> None:
        state = self._kinds.get(kind)
        if state is None:
            return
        state.recent.setdefault(threads, deque(maxlen=self.window)).append(seconds)
        if state.probing != threads:
            return
        state.probe_left -= 1
        if state.probe_left > 0:
            return
        state.probing = None
        probe, current = state.median(threads), state.median(state.choice)
        assert probe is not None
        if current is None or probe < current:
            logger.info(
                "%s steps: %d threads now (%.1f ms) rather than %d (%.1f ms)",
                kind,
                threads,
                1000 * probe,
                state.choice,
                1000 * (current or 0.0),
            )
            state.choice = threads
            state.probe_wait_s = self.min_probe_s
            self.num_switches += 1
        else:
            state.probe_wait_s = min(2 * state.probe_wait_s, self.max_probe_s)
            # a lost probe's steps say nothing about the next one: each probe starts afresh
            state.recent.pop(threads)
        state.next_probe_at = self._clock() + state.probe_wait_s

    def choices(self) -> dict[str, int]:
        """kind -> the thread count its steps use now."""
        return {kind: state.choice for kind, state in sorted(self._kinds.items())}

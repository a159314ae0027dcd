"""Threads per CPU step, chosen from the steps' own wall times while the engine runs.

Which thread count runs a step fastest depends on the machine and on its load, and both
change under a running worker. On 2 idle cores one sequence's decode step took 26-29 ms on
2 threads and 31-33 ms on 1; with another process taking a core (a build, a neighbour in the
same cgroup, a CPU quota below the core count) the 2-thread step took 350 ms, because each
OpenMP barrier waits for a thread that is not running (docs/benchmarks.md "Threads under
load"). A choice made once at start (the kernel plan's timing) is right for one of those
and badly wrong for the other.

So each kind of step (decode-only, by batch bucket; any step with prefill) keeps a moving
average of its wall time per thread count, runs the faster count, and now and then runs one
step on the other count to see whether the answer changed. A probe that confirms the
choice doubles the wait before the next (up to `max_probe_s`); a probe that overturns it
switches at once and resets the wait. The start-up plan only gives the first choice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class _Kind:
    """One kind of step: its averages per thread count and when to probe next."""

    choice: int
    averages: dict[int, float] = field(default_factory=dict)
    probe_wait_s: float = 0.0
    next_probe_at: float = 0.0
    probing: int | None = None


class ThreadChooser:
    """`pick(kind)` before a step, `record(kind, threads, seconds)` after it."""

    def __init__(
        self,
        options: list[int],
        initial: Callable[[str], int],
        min_probe_s: float = 2.0,
        max_probe_s: float = 60.0,
        smoothing: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = sorted(set(options))
        self._initial = initial
        self.min_probe_s = min_probe_s
        self.max_probe_s = max_probe_s
        self.smoothing = smoothing
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
        if len(self.options) > 1 and state.choice in state.averages:
            if self._clock() >= state.next_probe_at:
                state.probing = next(t for t in self.options if t != state.choice)
                return state.probing
        return state.choice

    def record(self, kind: str, threads: int, seconds: float) -> None:
        state = self._kinds.get(kind)
        if state is None:
            return
        previous = state.averages.get(threads)
        state.averages[threads] = (
            seconds if previous is None else previous + self.smoothing * (seconds - previous)
        )
        if state.probing != threads:
            return
        state.probing = None
        if state.averages[threads] < state.averages[state.choice]:
            logger.info(
                "%s steps: %d threads now (%.1f ms) rather than %d (%.1f ms)",
                kind,
                threads,
                1000 * state.averages[threads],
                state.choice,
                1000 * state.averages[state.choice],
            )
            state.choice = threads
            state.probe_wait_s = self.min_probe_s
            self.num_switches += 1
        else:
            state.probe_wait_s = min(2 * state.probe_wait_s, self.max_probe_s)
            # the probe's one step says little alone: forget it unless it keeps winning
            state.averages.pop(threads)
        state.next_probe_at = self._clock() + state.probe_wait_s

    def choices(self) -> dict[str, int]:
        """kind -> the thread count its steps use now."""
        return {kind: state.choice for kind, state in sorted(self._kinds.items())}

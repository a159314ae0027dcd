"""Threads per CPU step, chosen from the steps' own wall times while the engine runs.

Which thread count runs a step fastest depends on the machine and on its load, and both
change under a running worker. On 2 idle cores one sequence's decode step took 26-29 ms on
2 threads and 31-33 ms on 1; with another process taking a core (a build, a neighbour in the
same cgroup, a CPU quota below the core count) the 2-thread step took 350 ms, because each
OpenMP barrier waits for a thread that is not running (docs/benchmarks.md "Threads under
load"). A choice made once at start (the kernel plan's timing) is right for one of those
and badly wrong for the other.

So each kind of step (decode-only, by batch bucket; any step with prefill) keeps the wall times
of its recent steps per thread count, runs one count, and now and then probes the other: a few
steps on it, each followed by one on the current count, judged by the median of the pairs'
ratios. Pairs, because steps of one kind differ by a factor of 2 as a batch fills and drains
(a probe judged against older steps switched on a drain alone); medians, because one step
that met a garbage collection or the API's burst of work would otherwise move a kind to the
slower count (seen in the service: a 2-thread average of 293 ms against steps of 43 ms). A
kind's first probe comes after its first few steps, so a wrong first count costs those steps,
not seconds. A probe that loses, or wins by less than `margin` (`fewer_margin` for fewer
threads), doubles the wait before the next (up to `max_probe_s`; probes never cost more than
`probe_share` of the kind's time); one that wins switches at once and resets the wait. The
start-up plan only gives the first choice.
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
    probing: int | None = None  # the other count, while a probe runs
    probe_left: int = 0  # its steps still to run
    probe_turn: bool = False  # the next step is one of the probe's
    probe_times: list[float] = field(default_factory=list)
    baseline_times: list[float] = field(default_factory=list)  # the choice's, between them
    probed: bool = False  # its first probe is done
    last_probe_at: float = 0.0  # when it was created or its last probe ended

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
        first_probe_after: int = 4,
        margin: float = 0.05,
        fewer_margin: float = 0.25,
        probe_share: float = 0.05,
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
        # a new kind's first probe comes after this many steps on its first count, not after
        # `min_probe_s`: a wrong first count (no plan timed it) costs a few steps, not seconds
        self.first_probe_after = first_probe_after
        # a probe must be this much faster to switch: near-ties are noise, not a better count
        self.margin = margin
        # fewer threads must win by this much: the core they free idles unless another process
        # wants it, which no step time shows; the load this is for (a neighbour on a core)
        # makes steps several times slower, while the service's own bursts fake small wins
        self.fewer_margin = fewer_margin
        # probes after the first come at most this often, as a share of the kind's time: a
        # probe of a 1,024-token prefill chunk on half the cores costs about a chunk's time
        self.probe_share = probe_share
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
                last_probe_at=self._clock(),
            )
        if state.probing is not None:
            return state.probing if state.probe_turn else state.choice
        step = state.median(state.choice)
        if len(self.options) > 1 and step is not None:
            num_steps = len(state.recent[state.choice])
            probe_left = max(1, min(self.probe_steps, int(self.probe_budget_s / step)))
            now = self._clock()
            first_due = not state.probed and num_steps >= self.first_probe_after
            time_due = now >= state.next_probe_at and (
                now - state.last_probe_at >= probe_left * step / self.probe_share
            )
            if first_due or time_due:
                state.probing = next(t for t in self.options if t != state.choice)
                state.probe_left = probe_left
                state.probe_turn = True
                state.probe_times, state.baseline_times = [], []
                return state.probing
        return state.choice

    def record(self, kind: str, threads: int, seconds: float) -> None:
        state = self._kinds.get(kind)
        if state is None:
            return
        state.recent.setdefault(threads, deque(maxlen=self.window)).append(seconds)
        if state.probing is None:
            return
        # A probe alternates its steps with the choice's, so both see the same batch sizes,
        # context lengths and neighbours; the median of the pairs' ratios decides.
        if threads == state.probing and state.probe_turn:
            state.probe_times.append(seconds)
            state.probe_left -= 1
            state.probe_turn = False
            return
        state.baseline_times.append(seconds)
        state.probe_turn = state.probe_left > 0
        if state.probe_left > 0:
            return
        self._judge(kind, state)

    def _judge(self, kind: str, state: _Kind) -> None:
        assert state.probing is not None
        threads, state.probing = state.probing, None
        state.probed = True
        probe = statistics.median(state.probe_times)
        current = statistics.median(state.baseline_times)
        # each probe step against the choice's step right after it: a batch that drains or
        # grows between pairs moves both halves of a pair alike
        pairs = zip(state.probe_times, state.baseline_times, strict=True)
        ratio = statistics.median(p / b for p, b in pairs)
        if ratio < 1 - (self.fewer_margin if threads < state.choice else self.margin):
            logger.info(
                "%s steps: %d threads now (%.1f ms) rather than %d (%.1f ms)",
                kind,
                threads,
                1000 * probe,
                state.choice,
                1000 * current,
            )
            state.choice = threads
            state.recent[threads] = deque(state.probe_times, maxlen=self.window)
            state.probe_wait_s = self.min_probe_s
            self.num_switches += 1
        else:
            state.probe_wait_s = min(2 * state.probe_wait_s, self.max_probe_s)
            # a lost probe's steps say nothing about the next one: each probe starts afresh
            state.recent.pop(threads, None)
        state.last_probe_at = self._clock()
        state.next_probe_at = state.last_probe_at + state.probe_wait_s

    def choices(self) -> dict[str, int]:
        """kind -> the thread count its steps use now."""
        return {kind: state.choice for kind, state in sorted(self._kinds.items())}

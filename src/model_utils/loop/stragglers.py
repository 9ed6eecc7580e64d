"""The straggler report: which rank the others wait for, from every rank's step time split.

Each rank sums its turns' time over a window of --straggler_every turns (`StepTimes`): waiting for its data,
waiting for the others in the kit's per-step collective (loop/consensus.py, which also carries the sums to every
rank), and the rest, computing. The collective comes once every micro-batch's forward has run, before the first
backward's gradient reduction, so a slow rank's lateness lands in the others' wait there, not in their compute.
A rank's busy time (data + compute) above the ranks' median by more than --straggler_threshold, window after
window (PERSISTENCE of them), is a straggler (`StragglerJudge`); a single slow window (a checkpoint's page
cache flush, another process on the host) is not.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

PERSISTENCE = 3  # windows in a row a rank must be slow to be named


@dataclass(frozen=True)
class RankTimes:
    """One rank's seconds over a window of turns."""

    data_s: float
    compute_s: float
    sync_s: float

    @property
    def busy_s(self) -> float:
        """What the rank spent on its own work: the others wait for it when this is longer than theirs."""
        return self.data_s + self.compute_s


@dataclass
class StepTimes:
    """This rank's window: turns add to it, the collective that carries it takes it (and starts the next)."""

    turns: int = 0
    data_s: float = 0.0
    sync_s: float = 0.0
    total_s: float = 0.0

    def add(self, data_s: float, sync_s: float, total_s: float) -> None:
        self.turns += 1
        self.data_s += data_s
        self.sync_s += sync_s
        self.total_s += total_s

    def take(self) -> RankTimes:
        times = RankTimes(self.data_s, max(0.0, self.total_s - self.data_s - self.sync_s), self.sync_s)
        self.turns, self.data_s, self.sync_s, self.total_s = 0, 0.0, 0.0, 0.0
        return times


@dataclass(frozen=True)
class Spread:
    """One window's verdict: each rank's busy time against the median."""

    step: int
    median_busy_s: float
    ratios: tuple[float, ...]  # each rank's busy time / the median
    slow: tuple[int, ...]  # slower than the threshold in this window
    stragglers: tuple[int, ...]  # slow PERSISTENCE windows in a row: named
    newly_named: tuple[int, ...]  # named now and not in the window before

    @property
    def spread(self) -> float:
        """The slowest rank's busy time over the median (1.0: all alike)."""
        return max(self.ratios)

    def record(self, times: tuple[RankTimes, ...]) -> dict[str, object]:
        """The metrics file's record (docs/hangs.md)."""
        return {
            "event": "stragglers",
            "step": self.step,
            "median_busy_s": self.median_busy_s,
            "spread": self.spread,
            "slowest_rank": self.ratios.index(self.spread),
            "stragglers": list(self.stragglers),
            "busy_ratio": [round(r, 4) for r in self.ratios],
            "data_s": [round(t.data_s, 6) for t in times],
            "compute_s": [round(t.compute_s, 6) for t in times],
            "sync_s": [round(t.sync_s, 6) for t in times],
        }


@dataclass
class StragglerJudge:
    threshold: float  # --straggler_threshold: 0.1 = busy 10% longer than the median
    streaks: dict[int, int] = field(default_factory=dict)  # rank: slow windows in a row

    def judge(self, step: int, times: tuple[RankTimes, ...]) -> Spread:
        busy = [t.busy_s for t in times]
        # The lower median: with two ranks it is the faster one, not their mean (which hides half the gap).
        median = statistics.median_low(busy)
        ratios = tuple(b / median if median > 0 else 1.0 for b in busy)
        slow = tuple(r for r, ratio in enumerate(ratios) if ratio > 1 + self.threshold)
        before = {r for r, streak in self.streaks.items() if streak >= PERSISTENCE}
        self.streaks = {r: self.streaks.get(r, 0) + 1 for r in slow}
        named = tuple(r for r in slow if self.streaks[r] >= PERSISTENCE)
        return Spread(step, median, ratios, slow, named, tuple(r for r in named if r not in before))

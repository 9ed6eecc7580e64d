"""--straggler_every: every rank's step time split, carried by the per-step collective every N turns
(loop/consensus.py), judged on rank 0 (loop/stragglers.py): a persistently slow rank is named in one warning
line; each comparison is a record in the metrics file and a point on the tracker's straggler/ curves."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.loop.hooks import Observer, StepReport, Stop
from model_utils.loop.stragglers import StragglerJudge
from model_utils.observe.log import warn0

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.loop.reporter import Reporter


class Stragglers(Observer):
    def __init__(self, judge: StragglerJudge, reporter: Reporter) -> None:
        self.judge, self.reporter = judge, reporter

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Stragglers | None:
        loop = ctx.run.config.loop
        if not loop.straggler_every or ctx.dist.world_size == 1 or not ctx.dist.is_main:
            return None
        return cls(StragglerJudge(loop.straggler_threshold), ctx.reporter)

    def after_step(self, report: StepReport) -> Stop | None:
        times = report.rank_times
        if times is None:
            return None
        spread = self.judge.judge(report.step, times)
        for rank in spread.newly_named:
            t = times[rank]
            warn0(
                f"Straggler: rank {rank} is {100 * (spread.ratios[rank] - 1):.0f}% slower than the median rank "
                f"over the last comparisons (busy {t.busy_s:.3f} s against {spread.median_busy_s:.3f} s: data "
                f"{t.data_s:.3f} s, compute {t.compute_s:.3f} s; the others wait for it); docs/hangs.md"
            )
        record = spread.record(times)
        tracked = {"straggler/spread": spread.spread, "straggler/count": float(len(spread.stragglers))}
        self.reporter.measured(record, tracked)
        return None

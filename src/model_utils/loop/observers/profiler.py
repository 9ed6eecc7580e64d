"""`--profile_steps A:B` on rank 0 (observe/profiling.py): the profiler starts before step A's engine step, each
applied step is a range on its timeline, and after step B the trace is written, kept with the tracker's run, and
its writing is not a step (the throughput counts the steps' time)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.loop.hooks import Observer, StepReport, Stop
from model_utils.observe.profiling import StepProfiler

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.loop.reporter import Reporter


class Profiler(Observer):
    def __init__(self, profiler: StepProfiler, reporter: Reporter) -> None:
        self.profiler, self.reporter = profiler, reporter

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Profiler | None:
        window = ctx.run.config.report.profile_window()
        base = ctx.reporter.output_base  # rank 0's: where the metrics file goes
        if window is None or base is None:
            return None
        return cls(StepProfiler(window, base, ctx.dist.device, ctx.start_step), ctx.reporter)

    def before_step(self, step: int) -> None:
        self.profiler.step_starting(step)

    def after_step(self, report: StepReport) -> Stop | None:
        if not report.applied:
            return None
        trace = self.profiler.step_done(report.step)
        if trace is not None:
            self.reporter.artifact(trace, "profiler")
        return None

    def on_close(self) -> None:
        self.profiler.close()  # a run that stopped inside the window writes no trace

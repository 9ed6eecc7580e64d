"""--hang_timeout: this rank's progress (its step and phase, at the loop's points) goes to its watchdog thread
(observe/watchdog.py), which ends the job when a rank of this host stops advancing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.loop.hooks import Observer, StepReport, Stop
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext


class Watchdog(Observer):
    def __init__(self, monitor: watchdog.Monitor) -> None:
        self.monitor = monitor

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Watchdog | None:
        timeout = ctx.run.config.loop.hang_timeout
        if not timeout:
            return None
        from model_utils.launch import distributed

        def collective_trace() -> str | None:
            return distributed.dump_collective_trace(ctx.dist)

        return cls(watchdog.Monitor(ctx.dist.rank, timeout, dump_extra=collective_trace))

    def on_start(self, state: TrainState) -> None:
        self.monitor.progress(state.step + 1, watchdog.DATA)
        self.monitor.start()

    def on_phase(self, phase: str, step: int) -> None:
        self.monitor.progress(step, phase)

    def before_step(self, step: int) -> None:
        self.monitor.progress(step, watchdog.COMPUTE)

    def after_step(self, report: StepReport) -> Stop | None:
        if report.applied:
            self.monitor.step_took(report.seconds)
        return None

    def on_end(self, state: TrainState, reason: str) -> None:
        self.monitor.stop()  # what follows (uploads, the tracker's end) is no step

    def on_close(self) -> None:
        self.monitor.stop()

"""The job's time limit (launch/walltime.py) on rank 0: said at the start, and after each step rank 0 asks, through
the step's collective, for an early save (the next regular one would land too close to the end) or a save and a
stop (one more step would leave too little time to save); every save's time goes into the plan."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.launch import walltime
from model_utils.loop.hooks import SAVE, WALLTIME, Observer, SavedCheckpoint, StepReport
from model_utils.loop.state import TrainState
from model_utils.observe import step_line
from model_utils.observe.log import print0

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.loop.reporter import Reporter


class Walltime(Observer):
    def __init__(
        self, planner: walltime.WalltimePlanner, reporter: Reporter, checkpoint_freq: int, max_steps: int
    ) -> None:
        self.planner, self.reporter = planner, reporter
        self.checkpoint_freq, self.max_steps = checkpoint_freq, max_steps
        self.saving_early = False  # this rank asked for an early save

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Walltime | None:
        if not ctx.dist.is_main:
            return None  # rank 0 plans; the step's collective carries its say to the others
        assert ctx.run.max_steps is not None
        planner = walltime.WalltimePlanner()
        return cls(planner, ctx.reporter, ctx.run.config.checkpoint.checkpoint_freq, ctx.run.max_steps)

    def on_start(self, state: TrainState) -> None:
        remaining = self.planner.remaining()
        if remaining is not None:
            print0(
                f"Job time limit: {step_line.format_duration(remaining)} left; checkpoints are planned around it"
            )

    def requests(self, step: int) -> set[str]:
        next_save = min(self.max_steps, (step // self.checkpoint_freq + 1) * self.checkpoint_freq)
        decision = self.planner.decide(step, self.reporter.step_time(), next_save)
        self.saving_early = decision.save_now
        return ({SAVE} if decision.save_now else set()) | ({WALLTIME} if decision.stop_now else set())

    def time_left(self) -> float | None:
        return self.planner.remaining()

    def at_checkpoint(self, report: StepReport) -> None:
        if self.saving_early and not report.stop:
            print0(
                f"Saving early at step {report.state.step}: the next checkpoint would land too close to the time "
                "limit"
            )
        self.saving_early = False

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.planner.record_save(saved.save_s)

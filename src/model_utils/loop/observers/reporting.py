"""The reporter's output at the loop's points: the start, checkpoint and end records, a log line every
--logging_freq steps (the progress bar between them), the validation line. The reporter (observe/reporter.py)
renders them and fans them out to the metrics file and the tracker; its step clock is fed by the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model_utils.data.mixture import Mixture
from model_utils.loop.hooks import Observer, SavedCheckpoint, StepReport, Stop, Validation
from model_utils.loop.state import TrainState

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.observe.reporter import Reporter


class Reporting(Observer):
    def __init__(
        self,
        reporter: Reporter,
        logging_freq: int,
        max_steps: int,
        world_size: int,
        resumed_from: str | None,
        mixture: Mixture | None = None,
        validation_only: bool = False,
    ) -> None:
        self.reporter = reporter
        self.validation_only = validation_only  # said in the start record: the run validates and ends
        self.logging_freq, self.max_steps, self.world_size = logging_freq, max_steps, world_size
        self.resumed_from = resumed_from  # the tag the run resumed from
        self.mixture = mixture  # a mixture's shares go in the start record and every logged step

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Reporting:
        resume = ctx.run.resume
        assert ctx.run.max_steps is not None
        blocks = ctx.run.train_blocks
        return cls(
            ctx.reporter,
            ctx.run.config.loop.logging_freq,
            ctx.run.max_steps,
            ctx.dist.world_size,
            resume.tag if resume is not None else None,
            blocks if isinstance(blocks, Mixture) else None,
            ctx.run.config.loop.validation_only,
        )

    def on_start(self, state: TrainState) -> None:
        self.reporter.event(
            {
                "event": "start",
                "step": state.step,
                "run_id": state.run_id,
                "resumed_from": self.resumed_from,
                "world_size": self.world_size,
                "max_steps": self.max_steps,
                **({} if self.mixture is None else {"sources": self.mixture.plan.to_dict()}),
                **({"validation_only": True} if self.validation_only else {}),
            }
        )

    def after_step(self, report: StepReport) -> Stop | None:
        if not report.trained:
            return None
        step = report.step
        if step % self.logging_freq == 0 or step == self.max_steps:
            shares = None if self.mixture is None else self.mixture.shares_read(report.state.position)
            self.reporter.log_step(report.state, report.lr, report.grad_norm, report.time_left, shares)
        else:
            self.reporter.progress(step, report.loss)
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        self.reporter.log_validation(step, validation)
        return None

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.reporter.event(
            {"event": "checkpoint", "step": saved.step, "tag": saved.tag, "save_s": saved.save_s}
        )

    def on_end(self, state: TrainState, reason: str) -> None:
        self.reporter.event({"event": "end", "step": state.step, "reason": reason})

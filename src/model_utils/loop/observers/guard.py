"""--spike_guard (loop/spike_guard.py's judgement): a step whose loss over all ranks spikes makes no update, several
in a row stop the run or roll it back, a grad-norm spike is reported or rolled back; data a rollback ruled out is
passed over when training reaches it again. Each verdict is a warning line, a record in the metrics file (what
`dskit plot` marks) and a point on the tracker's spike_guard/ curves. Its windows and counters are its state in
every checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from model_utils.data.sampler import DataPosition
from model_utils.errors import RunDiverged
from model_utils.loop import spike_guard
from model_utils.loop.hooks import DISCARDED, Observer, Rollback, StepReport
from model_utils.observe.log import print0, warn0

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.loop.reporter import Reporter


class Guard(Observer):
    name = "spike_guard"

    def __init__(self, guard: spike_guard.SpikeGuard, reporter: Reporter) -> None:
        self.guard, self.reporter = guard, reporter
        self.loss = float("nan")  # the last step's loss over all ranks
        self.spike: spike_guard.Spike | None = None  # what it saw in that loss
        self.passed_over: tuple[DataPosition, int] | None = None  # data being passed over: from where, steps
        self.position = DataPosition()  # the data of the step about to run

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Guard | None:
        guard = spike_guard.SpikeGuard(ctx.run.config.guard, ctx.run.settings.spike_guard)
        guard.load_state_dict(ctx.saved.get(cls.name, {}))
        print0(guard.describe())
        return cls(guard, ctx.reporter) if guard.active else None

    def state_dict(self) -> dict[str, Any]:
        return self.guard.state_dict()

    def takes(self, position: DataPosition) -> bool:
        if self.guard.skips_data_at(position):
            start, steps = self.passed_over or (position, 0)
            self.passed_over = (start, steps + 1)
            return False
        if self.passed_over is not None:
            start, steps = self.passed_over
            print0(
                f"Spike guard: skipped {steps} steps of data from epoch {start.epoch} block {start.consumed} (what "
                "led to a rollback)"
            )
            self.passed_over = None
        self.position = position
        return True

    def before_step(self, step: int) -> None:
        # The step runs: its data is the position this observer took last (a later one may have passed over some).
        self.guard.step_starting(self.position)

    def keeps(self, step: int, loss: float) -> bool:
        self.loss = loss
        self.spike = self.guard.judge_loss(step, loss)
        return self.spike is None

    def judge(self, report: StepReport) -> Rollback | None:
        guard, step = self.guard, report.step
        if report.outcome == DISCARDED:
            assert self.spike is not None
            action = guard.step_skipped()
            warn0(
                f"Spike guard: skipped step {step}: {self.spike.describe()}: no update, its data is consumed "
                f"({guard.consecutive_skips} in a row, {guard.skipped_steps} in the run)"
            )
            self._event(spike_guard.SPIKE_SKIP, step, self.spike.to_dict())
            if action == spike_guard.STOP:
                self._diverged(
                    step - 1,
                    f"{guard.consecutive_skips} steps in a row skipped as loss spikes (--max_consecutive_skips): the "
                    "model, not one batch, went wrong; resume with --spike_guard rollback to go back to the last "
                    "checkpoint, or lower --lr",
                )
            if action == spike_guard.ROLLBACK:
                return self._roll_back(f"{guard.consecutive_skips} loss spikes in a row", step - 1, must=True)
            return None
        spike, action = guard.step_applied(step, self.loss, report.grad_norm)
        if spike is None:
            return None
        self._event(spike_guard.SPIKE_GRAD_NORM, step, spike.to_dict())
        if action == spike_guard.ROLLBACK:
            return self._roll_back(f"{spike.describe()} at step {step}", step, must=False)
        warn0(
            f"Spike guard: step {step}'s {spike.describe()}: the update is applied (DeepSpeed computes the norm in "
            "its optimizer step); --spike_guard rollback would go back to the last checkpoint"
        )
        return None

    def _roll_back(self, why: str, step: int, must: bool) -> Rollback:
        if not self.guard.may_roll_back():
            self._diverged(
                step,
                f"{why} after {self.guard.rollbacks} rollbacks (--max_rollbacks {self.guard.args.max_rollbacks}): "
                "the run keeps diverging; lower --lr, or inspect the data around the skipped ranges in the metrics "
                "file",
            )
        return Rollback(why, must)

    def after_rollback(self, rollback: Rollback) -> None:
        guard = self.guard
        start, end = guard.rolled_back(
            rollback.saved.get(self.name, {}), rollback.position, rollback.from_position
        )
        warn0(
            f"Spike guard: {rollback.why}: rolled back from step {rollback.from_step} to step {rollback.step} "
            f"({rollback.tag}); the data from epoch {start.epoch} block {start.consumed} to epoch {end.epoch} block "
            f"{end.consumed} will be skipped (rollback {guard.rollbacks} of at most {guard.args.max_rollbacks})"
        )
        self._event(
            spike_guard.ROLLBACK,
            rollback.step,
            {
                "from_step": rollback.from_step,
                "tag": rollback.tag,
                "reason": rollback.why,
                "skip_from": start.to_dict(),
                "skip_to": end.to_dict(),
            },
        )

    def _event(self, kind: str, step: int, fields: dict[str, Any]) -> None:
        """The metrics file's record (docs/spike-guard.md) and the tracker's counters."""
        self.reporter.measured({"event": kind, "step": step, **fields}, self.guard.counters())

    @staticmethod
    def _diverged(step: int, why: str) -> None:
        raise RunDiverged(f"the spike guard stopped the run at step {step}: {why}")

"""The run's goodput ledger: where each attempt's paid time went, appended as JSON lines to one file in the
checkpoint dir (every attempt of a run, requeues and resumes included, writes to the same file), read by
`dskit cost` (dskit/cost.py).

One attempt is one start of the ranks. Rank 0 appends, in order:

    start       when the launcher started (DSKIT_LAUNCHED_AT, set by the rendered launchers; else this process's
                start), when the job was submitted (SLURM's SubmitTime, where scontrol answers), the nodes and
                devices it holds, the instance type, and the step it starts at (a resume's)
    steps       every STEPS_EVERY_S and at the ends: the turns since the last record, split into trained and
                not (spike-guard discards, test faults), with the first and last trained step, seconds, and
                the last trained step's loss (rank 0's)
    validation  each validation's seconds, tokens and loss
    evaluation  each evaluation at the loop's evaluation point (the samples): its phase and seconds
    checkpoint  each save's seconds (what the loop waited for)
    rollback    the spike guard went back from one step to an earlier one (those steps are trained again)
    end         the loop ended: its reason and step
    closed      the trainer closed (errors too)
    exit        torchrun ended, with its status (launch/supervise.py on rank 0's node, which the ranks tell where
                the ledger is through DSKIT_LEDGER_POINTER): the attempt's paid time ends here

Without a launcher of the kit (or a crash of the launcher itself) the last record is the attempt's end: `closed`,
or at worst a `steps` record at most STEPS_EVERY_S old. Times are Unix seconds
from the wall clock of rank 0's host.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from model_utils import launch_env
from model_utils.loop.hooks import Observer, Rollback, SavedCheckpoint, StepReport
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog
from model_utils.observe.ledger_file import LEDGER, append, instance_type, job_record, process_started_at

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext
    from model_utils.observe.metrics import Validation

STEPS_EVERY_S = 30.0


class Ledger(Observer):
    """Rank 0's writer of the ledger (the module docstring has its records)."""

    def __init__(self, path: Path, start: dict[str, Any]) -> None:
        self.path = path
        self.start = start
        self._steps: dict[str, Any] | None = None  # the turns not yet written
        self._last_write = time.monotonic()
        self._last_turn_end = time.time()
        self._closed = False

    @classmethod
    def from_loop(cls, ctx: LoopContext) -> Ledger | None:
        if not ctx.dist.is_main:
            return None
        local = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.dist.world_size) or ctx.dist.world_size)
        launched = os.environ.get(launch_env.LAUNCHED_AT)
        start = {
            "launched_at": float(launched) if launched else process_started_at(),
            "job": job_record(),
            "nodes": max(1, ctx.dist.world_size // max(1, local)),
            "ranks": ctx.dist.world_size,
            "device": ctx.dist.device.type,
            "instance_type": instance_type(),
            "step": ctx.start_step,
            "tokens_per_step": ctx.run.tokens_per_step,
        }
        return cls(Path(ctx.run.config.checkpoint.checkpoint_dir) / LEDGER, start)

    def _append(self, event: str, **fields: Any) -> None:
        append(self.path, event, **fields)

    def _flush_steps(self) -> None:
        if self._steps is not None:
            self._append("steps", **self._steps)
            self._steps = None
        self._last_write = time.monotonic()

    def on_start(self, state: TrainState) -> None:
        self._append("start", **self.start)
        pointer = os.environ.get(launch_env.LEDGER_POINTER)
        if pointer:
            Path(pointer).write_text(str(self.path.resolve()))
        self._last_turn_end = time.time()

    def after_step(self, report: StepReport) -> None:
        now = time.time()
        if self._steps is None:
            self._steps = {"started_at": now - report.seconds, "trained": 0, "trained_s": 0.0}
            self._steps.update(untrained=0, untrained_s=0.0, first=None, last=None)
        kind = "trained" if report.trained else "untrained"
        self._steps[kind] += 1
        self._steps[f"{kind}_s"] += report.seconds
        # The trained steps of a record are consecutive: a discarded turn's step is retried.
        if report.trained:
            self._steps["first"] = self._steps["first"] or report.step
            self._steps["last"] = report.step
            self._steps["loss"] = report.loss  # the last one's (rank 0's): what a model card reports
        self._last_turn_end = now
        if time.monotonic() - self._last_write >= STEPS_EVERY_S:
            self._flush_steps()
        return None

    def after_validation(self, step: int, validation: Validation) -> None:
        # Validation runs right after the step's observers: from the step's end to here.
        self._flush_steps()
        self._append(
            "validation",
            step=step,
            seconds=time.time() - self._last_turn_end,
            tokens=validation.targets,
            loss=validation.loss,
        )
        return None

    def after_evaluation(self, step: int, phase: str, seconds: float) -> None:
        if phase == watchdog.VALIDATION:
            return  # its own record (after_validation)
        self._flush_steps()
        self._append("evaluation", step=step, phase=phase, seconds=seconds)

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self._flush_steps()
        self._append("checkpoint", step=saved.step, seconds=saved.save_s)

    def after_rollback(self, rollback: Rollback) -> None:
        self._flush_steps()
        self._append("rollback", from_step=rollback.from_step, to_step=rollback.step)

    def on_end(self, state: TrainState, reason: str) -> None:
        self._flush_steps()
        self._append("end", step=state.step, reason=reason)

    def on_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._flush_steps()
        self._append("closed")

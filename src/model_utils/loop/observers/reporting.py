"""The reporter's output (loop/reporter.py), fed from the loop's points alone: what runs (said at the start),
the start, checkpoint and end records, a log line every --logging_freq steps (the progress bar between them, the
step clock fed with each step), the validation line, and the end line. The reporter renders them and fans them
out to the metrics file and the tracker, whose run (its state: the tracker's ids) a resume continues."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from model_utils.data.mixture import Mixture
from model_utils.launch.preemption import slurm_restart_count
from model_utils.loop.hooks import (
    INTERRUPTED,
    ROLLED_BACK,
    Observer,
    Rollback,
    SavedCheckpoint,
    StepReport,
    Stop,
    Validation,
)
from model_utils.loop.state import REPORTING, TrainState
from model_utils.observe import metrics, step_line
from model_utils.observe.log import print0

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext


class Reporting(Observer):
    name = REPORTING

    def __init__(self, ctx: LoopContext, time_left: Callable[[], float | None]) -> None:
        run, dist, reporter = ctx.run, ctx.dist, ctx.reporter
        assert run.max_steps is not None
        self.run, self.reporter, self.time_left = run, reporter, time_left
        self.engine_title, self.device = type(ctx.engine).title, dist.device
        self.logging_freq, self.max_steps = run.config.loop.logging_freq, run.max_steps
        self.world_size, self.readers = dist.world_size, dist.readers
        self.resumed_from = run.resume.tag if run.resume is not None else None
        blocks = run.train_blocks
        self.mixture = (
            blocks if isinstance(blocks, Mixture) else None
        )  # its shares: the start record, each line
        self.validation_only = run.config.loop.validation_only
        resumed_at = ctx.state.step if run.resume is not None else None
        tracker = ctx.saved.get(self.name, {}).get("tracker", {})
        self.tracker = reporter.open(ctx.state.run_id, tracker, resumed_at)
        self.last: StepReport | None = None  # the last step, as decided (at_checkpoint)
        self.started = time.perf_counter()

    def state_dict(self) -> dict[str, Any]:
        return {"tracker": self.tracker}

    def on_start(self, state: TrainState) -> None:
        run = self.run
        ranks = self.readers + (" sharing each sequence" if run.sequence_parallel > 1 else "")
        print0(
            f"Training {run.source.name} with {self.engine_title} for {self.max_steps} steps: {ranks}"
            f" x micro batch {run.micro_batch_size} x accumulation {run.gradient_accumulation_steps} x "
            f"{'pairs of 2 x ' if run.paired else ''}{run.seq_length} tokens = {run.tokens_per_step} tokens/step, "
            f"{run.steps_per_epoch} steps/epoch"
        )
        restarts = slurm_restart_count()
        if restarts is not None:
            print0(f"SLURM job {os.environ['SLURM_JOB_ID']}, SLURM_RESTART_COUNT={restarts}")
        reporter = self.reporter
        peak = reporter.peak_tflops
        peak_text = "unknown: pass --peak_tflops for MFU" if peak is None else f"{peak:g}"
        print0(
            f"FLOPs/token {reporter.flops_per_token / 1e9:.3g} G "
            f"({'4N frozen + 6N adapters' if run.config.lora.enabled else '6N'} + attention); "
            f"{metrics.device_name(self.device)} peak bf16 TFLOP/s {peak_text}"
        )
        if state.step >= self.max_steps and not self.validation_only:
            print0(f"Nothing to train: already at step {state.step} of {self.max_steps}")
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
        self.started = time.perf_counter()
        self.reporter.restart_clock()

    def after_rollback(self, rollback: Rollback) -> None:
        self.reporter.restart_clock()  # the steps since the last log line are undone, and not logged

    def after_step(self, report: StepReport) -> Stop | None:
        if report.outcome != ROLLED_BACK:  # a rollback restarted the interval: its step is not in it
            self.reporter.step_clocked(report)
        if not report.trained:
            return None
        step = report.step
        if step % self.logging_freq == 0 or step == self.max_steps:
            shares = None if self.mixture is None else self.mixture.shares_read(report.state.position)
            self.reporter.log_step(report, self.time_left(), shares)
        else:
            self.reporter.progress(step, report.loss)
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        self.reporter.log_validation(step, validation)
        return None

    def at_checkpoint(self, report: StepReport) -> None:
        self.last = report

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.reporter.event(
            {"event": "checkpoint", "step": saved.step, "tag": saved.tag, "save_s": saved.save_s}
        )

    def on_end(self, state: TrainState, reason: str) -> None:
        self.reporter.event({"event": "end", "step": state.step, "reason": reason})
        self.reporter.close()  # the progress bar goes before the closing lines
        last = self.last
        if reason == step_line.VALIDATED:
            print0(step_line.validated_line(state.step))
            return
        if reason == "preempted":
            interrupted = last is not None and INTERRUPTED in last.requests
            by = "Ctrl-C" if interrupted else (last.stopped_by if last else None) or "another rank"
            print0(step_line.preempted_line(state.step, by))
        elif reason == "walltime":
            print0(step_line.walltime_line(state.step))
        elif reason == "done":
            print0(step_line.done_line(state.step, self.max_steps, state.tokens_seen))
        elif reason != "diverged":  # a diverged run ends with its error line
            why = (last.stopped_by if last else None) or "asked on another rank"
            print0(step_line.stopped_line(state.step, reason, why))
        train_s = time.perf_counter() - self.started
        if train_s > 0 and reason != "diverged":
            overhead = self.reporter.overhead_s
            print0(
                f"Metrics overhead: {overhead:.3f} s of {train_s:.1f} s training ({100 * overhead / train_s:.2f}%)"
            )

    def on_close(self) -> None:
        self.reporter.close()

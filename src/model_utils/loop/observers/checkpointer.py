"""Checkpoints: saved every --checkpoint_freq steps and after the last one, when the ranks agreed a save or a stop
(a signal, the job's time limit, an observer's Stop), and every --checkpoint_interval_minutes; then rotated
(--keep_checkpoints, --keep_every_steps; never the resumed tag or one an observer still reads). A save holds the
loop's state and every observer's, by name. The crash-safe protocol itself is checkpoint/protocol.py.

A stopping run's rank 0 then writes why it stopped to the launcher's stop-reason file (DSKIT_STOP_REASON_FILE): the
launcher's reason to requeue, and its word that the stop's checkpoint is saved."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from model_utils import launch_env
from model_utils.checkpoint import launch_record, protocol
from model_utils.loop.hooks import SAVE, Observer, SavedCheckpoint, StepReport
from model_utils.loop.state import OBSERVERS, TrainState
from model_utils.observe import watchdog

if TYPE_CHECKING:
    from model_utils.loop.observers.context import LoopContext


class Checkpointer(Observer):
    def __init__(self, ctx: LoopContext) -> None:
        run = ctx.run
        self.run, self.engine, self.hooks, self.rank = run, ctx.engine, ctx.hooks, ctx.dist.rank
        self.args = run.config.checkpoint
        resolved = {**run.to_dict()["resolved"], "optimizer_groups": ctx.optimizer_groups}
        self.launch = launch_record.collect(
            run.config.to_dict(), resolved, run.deepspeed_config(), ctx.dist.world_size
        )
        self.last_save = time.monotonic()

    def requests(self, step: int) -> set[str]:
        minutes = self.args.checkpoint_interval_minutes
        return {SAVE} if minutes is not None and time.monotonic() - self.last_save >= 60 * minutes else set()

    def at_checkpoint(self, report: StepReport) -> None:
        step = report.state.step
        due = report.trained and (step % self.args.checkpoint_freq == 0 or report.last)
        if due or report.stop or SAVE in report.requests:
            self.save(report.state)
        if report.stop and self.rank == 0 and os.environ.get(launch_env.STOP_REASON_FILE):
            reason_file = Path(os.environ[launch_env.STOP_REASON_FILE])
            reason_file.parent.mkdir(parents=True, exist_ok=True)
            reason_file.write_text(report.stop + "\n")

    def save(self, state: TrainState) -> None:
        self.hooks.on_phase(watchdog.CHECKPOINT, state.step)
        started = time.perf_counter()
        tag = protocol.checkpoint_tag(self.run.source.short_name, state.step)
        request = protocol.SaveRequest(
            checkpoint_dir=self.args.checkpoint_dir,
            tag=tag,
            step=state.step,
            train_state={**state.to_dict(), OBSERVERS: self.hooks.state_dicts()},
            config=self.run.config.to_dict(),
            launch=self.launch,
        )
        final = protocol.save(self.engine, request, self.rank, self.run.model_config, self.run.tokenizer)
        if final is not None:
            protect = {self.run.resume.tag} if self.run.resume else set()
            protect |= self.hooks.tags_in_use(tag)  # e.g. uploads in flight
            protocol.rotate(
                final.parent,
                self.args.keep_checkpoints,
                protect,
                self.args.keep_every_steps,
                type(self.engine),
            )
        self.hooks.after_checkpoint_saved(
            SavedCheckpoint(state.step, tag, final, time.perf_counter() - started)
        )
        self.last_save = time.monotonic()

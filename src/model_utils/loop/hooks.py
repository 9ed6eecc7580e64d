"""The loop's observer seam: what watches the training (the reporter, the profiler, the S3 uploads, the spike
guard's records; evaluators, watchdogs, trackers to come) hangs off named points of the loop, one file each
(loop/observers/), and the Trainer keeps the loop logic alone.

The Trainer calls `Hooks` at each point; `Hooks` calls every observer in the order it was given them
(observers.build: the reporter's output last, so what others report through it at a point, such as a profiler
trace, comes before its own lines). The points, in the order a run meets them:

    on_start(state)                          once, before the first step (a resumed run too)
    per turn of the loop:
        on_phase(phase, step)                the loop enters a phase of `step`: data, decision (the kit's per-step
                                             collective), validation, samples, checkpoint (what a watchdog follows)
        before_step(step)                    the step's data is fetched; the engine runs it next (phase compute)
        on_guard_event(event)                the spike guard skipped the step, saw a grad-norm spike, rolled back
        after_step(report)                   every turn: trained, discarded, rolled back or dropped
        after_validation(step, validation)   when validation was due: its loss and what it covered
        evaluate(step, last)                 after a trained step: each observer whose evaluation_due names a
                                             phase (the samples) runs it, the watchdog told of that phase first
        after_evaluation(step, phase, s)     each evaluation just run: its phase and seconds (the ledger's)
        tags_in_use(tag) -> set[str]         rank 0, a checkpoint `tag` was saved: rotation spares these tags
        after_checkpoint_saved(saved)        after the rotation
    on_end(state, reason)                    the loop ended: done, preempted, walltime, diverged, validated (--validation_only), or a Stop's reason
    on_close()                               always, errors too, last (Trainer.close)

Every rank meets every point but tags_in_use (an observer that writes does so on rank 0, as the reporter does);
the collectives the loop needs are the Trainer's. Time an observer spends within a turn (before_step,
on_guard_event, after_step) counts as training in the throughput unless it says otherwise (`Reporter.exclude`, as
the profiler does for writing its trace); validation, evaluation and checkpoint time is left out already.

The way back is typed: `after_step` and `after_validation` may return a `Stop`, which the loop honours like a
preemption (every rank saves and stops after the same step: with one rank after this step; with several, after
the next one, whose per-step collective (loop/consensus.py) carries it to the others); `tags_in_use` names checkpoints that
must stay on disk. Nothing else of the Trainer is an observer's to change. An observer's exception is not caught:
it ends the run as the reporter's errors always did (the entry point's one-line ConfigError, else a traceback),
and Trainer.close still closes every observer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from model_utils.data.sampler import DataPosition
from model_utils.loop.spike_guard import Spike
from model_utils.loop.state import TrainState
from model_utils.loop.stragglers import RankTimes
from model_utils.observe.metrics import Validation

# What became of a turn of the loop (StepReport.outcome).
TRAINED = "trained"  # the optimizer step was applied and stands
DISCARDED = "discarded"  # the spike guard saw the loss spike: no update, the data is consumed
ROLLED_BACK = "rolled_back"  # applied, then the spike guard went back to the last checkpoint
DROPPED = "dropped"  # a test fault consumed the data without training (loop/faults.py)


@dataclass(frozen=True)
class StepReport:
    """One turn of the loop, for every observer: what a watchdog times, what a tracker logs."""

    step: int  # the optimizer step the turn ran; it stands only when `trained`
    outcome: str  # TRAINED, DISCARDED, ROLLED_BACK or DROPPED
    loss: float  # this rank's mean loss over the step's micro-batches; NaN when no update was applied
    lr: float  # the lr the step ran at
    grad_norm: float | None  # the engine's global gradient norm of an applied step, if it computed one
    data_wait_s: float  # of `seconds`, waiting for the step's batches
    seconds: float  # the whole turn: data, forward, backward, optimizer step, the guard's verdict
    time_left: float | None  # the job's time left (rank 0 under a time limit), else None
    state: TrainState  # the loop's state after the turn (a rollback's restored one): to read, never to change
    sync_wait_s: float = 0.0  # of `seconds`, waiting for the other ranks in the kit's per-step collective
    # Every rank's step time split over the last --straggler_every turns, when this turn's collective carried it
    rank_times: tuple[RankTimes, ...] | None = None

    @property
    def trained(self) -> bool:
        return self.outcome == TRAINED

    @property
    def applied(self) -> bool:
        """The engine updated the weights in this turn (it may have been rolled back since)."""
        return self.outcome in (TRAINED, ROLLED_BACK)


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    tag: str
    path: Path | None  # the verified tag dir on rank 0; None on the other ranks
    save_s: float  # writing, verifying and rotating, as the loop waited for it


@dataclass(frozen=True)
class Rollback:
    """Where a rollback went and the data it rules out: [skip_from, skip_to) is never trained on again."""

    from_step: int
    tag: str
    reason: str
    skip_from: DataPosition
    skip_to: DataPosition


@dataclass(frozen=True)
class GuardEvent:
    """A spike guard skip ("spike_skip"), grad-norm spike ("spike_grad_norm") or rollback ("rollback")."""

    kind: str
    step: int  # the step skipped or judged; a rollback's: the step it went back to
    counters: dict[str, float]  # the guard's totals over the run (skipped steps, rollbacks)
    spike: Spike | None = None  # what the guard saw (skips and grad-norm spikes)
    rollback: Rollback | None = None


@dataclass(frozen=True)
class Stop:
    """An observer's request to end the run after this step, saved (a requeue or --resume continues it).

    `reason`: one word for the metrics file's end record and the launcher's stop-reason file (a launcher requeues
    only after "walltime" or a preemption); `why`: the log's explanation."""

    reason: str
    why: str


class Observer:
    """Named points of the loop (the module docstring has their order); each one does nothing here."""

    def on_start(self, state: TrainState) -> None:
        pass

    def on_phase(self, phase: str, step: int) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, report: StepReport) -> Stop | None:
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        return None

    def evaluation_due(self, step: int, last: bool) -> str | None:
        """The watchdog phase (observe/watchdog.py) of an evaluation this observer runs after trained step `step`
        (`last`: the run's last), or None when it has none due. Every rank must answer alike."""
        return None

    def evaluate(self, step: int) -> None:
        """Run the evaluation evaluation_due named, on every rank (a sharded model's forward needs them all)."""

    def after_evaluation(self, step: int, phase: str, seconds: float) -> None:
        """An evaluation (of any observer) ran after trained step `step`: its watchdog phase and wall seconds."""

    def tags_in_use(self, tag: str) -> set[str]:
        """Local checkpoint tags this observer still reads (an upload in flight), `tag` (just saved, not yet
        handed to after_checkpoint_saved) included if it will: checkpoint rotation does not delete them."""
        return set()

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        pass

    def on_guard_event(self, event: GuardEvent) -> None:
        pass

    def on_end(self, state: TrainState, reason: str) -> None:
        pass

    def on_close(self) -> None:
        """Release what the observer holds; runs on every exit path, after an error too. Idempotent."""


@dataclass
class Hooks:
    """The Trainer's one handle on its observers: each point calls them all, in order."""

    observers: Sequence[Observer] = ()
    stop: Stop | None = field(default=None, init=False)  # the first Stop asked for on this rank
    # The points called several times a step, each with the observers that do something there: a call of the
    # base class's nothing costs as much as a real one (a few us, 15 a step).
    _acting: dict[str, tuple[Observer, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._acting = {
            point: tuple(o for o in self.observers if getattr(type(o), point) is not getattr(Observer, point))
            for point in ("on_phase", "before_step", "evaluation_due")
        }

    def _asked(self, request: Stop | None) -> None:
        if request is not None and self.stop is None:
            self.stop = request

    def on_start(self, state: TrainState) -> None:
        for observer in self.observers:
            observer.on_start(state)

    def on_phase(self, phase: str, step: int) -> None:
        for observer in self._acting["on_phase"]:
            observer.on_phase(phase, step)

    def before_step(self, step: int) -> None:
        for observer in self._acting["before_step"]:
            observer.before_step(step)

    def after_step(self, report: StepReport) -> None:
        for observer in self.observers:
            self._asked(observer.after_step(report))

    def after_validation(self, step: int, validation: Validation) -> None:
        for observer in self.observers:
            self._asked(observer.after_validation(step, validation))

    def evaluate(self, step: int, last: bool) -> None:
        for observer in self._acting["evaluation_due"]:
            phase = observer.evaluation_due(step, last)
            if phase is not None:
                self.on_phase(phase, step)  # the watchdog allows an evaluation as long as a validation
                started = time.perf_counter()
                observer.evaluate(step)
                seconds = time.perf_counter() - started
                for told in self.observers:
                    told.after_evaluation(step, phase, seconds)

    def tags_in_use(self, tag: str) -> set[str]:
        return set().union(*(observer.tags_in_use(tag) for observer in self.observers))

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        for observer in self.observers:
            observer.after_checkpoint_saved(saved)

    def on_guard_event(self, event: GuardEvent) -> None:
        for observer in self.observers:
            observer.on_guard_event(event)

    def on_end(self, state: TrainState, reason: str) -> None:
        for observer in self.observers:
            observer.on_end(state, reason)

    def on_close(self) -> None:
        """Every observer is closed, even after one failed to; then the first failure is raised."""
        failed: list[BaseException] = []
        for observer in self.observers:
            try:
                observer.on_close()
            except BaseException as err:  # re-raised below, once the others are closed
                failed.append(err)
        if failed:
            raise failed[0]

"""The loop's one way to be extended: observers on named points, one file each (loop/observers/), each saving its
own state by name in the checkpoint. The Trainer keeps the loop alone (start, the step, finish) and calls `Hooks`
at each point; `Hooks` calls every observer in the order it was given them (observers.build: the reporter's output
last, so what others report through it at a point comes before its own lines). The points, in the order a run
meets them:

    on_start(state)                          once, before the first step (a resumed run too)
    evaluate(step, start=True)               then each observer whose evaluation_due names a phase runs it (the
                                             validation of --validation_at_start, --validation_only)
    per step:
        takes(position) -> bool              the step's data: False passes over it without training (data a
                                             rollback ruled out; a test's dropped step); the observers after the
                                             first False are not asked
        on_phase(phase, step)                the loop enters a phase of `step`: data, decision (the step's one
                                             collective), validation, samples, checkpoint (what a watchdog follows)
        before_step(step)                    the step's data is fetched; the engine runs it next (phase compute)
        requests(step) -> set[str]           this rank's say in the step's collective (REQUESTS: save, stop ...)
        keeps(step, loss) -> bool            the step's loss over all ranks, before the update: False discards it
        judge(report) -> Rollback | None     the step's verdict once it ran (the spike guard's): go back?
        after_rollback(rollback)             the loop went back to a checkpoint (a Rollback's request)
        after_step(report)                   every step: trained, discarded or rolled back
        evaluate(step)                       after a trained step: each observer whose evaluation_due names a phase
                                             runs it (validation, samples), the watchdog told of that phase first;
            after_validation(step, v)        a validation's result, for everyone
            after_evaluation(step, phase, s) each evaluation's phase and seconds
        at_checkpoint(report)                the checkpointer saves when due or asked (a stop saves first)
            tags_in_use(tag) -> set[str]     rank 0, a checkpoint was saved: rotation spares these tags
            after_checkpoint_saved(saved)    after the rotation
    on_end(state, reason)                    the loop ended: done, preempted, walltime, diverged, validated
                                             (--validation_only), or a Stop's reason
    on_close()                               always, errors too, last (Trainer.close)

Every rank meets every point but tags_in_use (an observer that writes does so on rank 0, as the reporter does).
The way back is typed: `after_step` and `after_validation` may return a `Stop`, which the loop honours like a
preemption (every rank saves and stops after the same step: with one rank after this step; with several, after
the next one, whose collective carries it to the others); `judge` a `Rollback`; `tags_in_use` names checkpoints
that must stay on disk; `requests` and `keeps` go through the step's collective. An observer's exception is not
caught: it ends the run (the entry point's one-line ConfigError, else a traceback), and Trainer.close still closes
every observer.

State: an observer with a `name` keeps `state_dict()` in every checkpoint under that name and gets it back when it
is built on a resume (`from_loop`: LoopContext.saved, by name; a rollback's in `after_rollback`: Rollback.saved);
the Trainer's TrainState keeps only the step, the tokens, the data position and the run id.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from model_utils.data.sampler import DataPosition
from model_utils.loop.state import TrainState
from model_utils.loop.stragglers import RankTimes
from model_utils.observe.metrics import Validation

# What became of a step (StepReport.outcome).
TRAINED = "trained"  # the optimizer step was applied and stands
DISCARDED = "discarded"  # an observer's `keeps` said no (a loss spike): no update, the data is consumed
ROLLED_BACK = "rolled_back"  # applied, then an observer's `judge` went back to the last checkpoint

# What a rank may ask of the step's collective (each raised anywhere holds for every rank), in its order there:
# a save after the step; a stop after it, saved: by a signal (preemption), by Ctrl-C (also a preemption), by the
# job's time limit, by an observer's Stop.
SAVE, PREEMPTED, INTERRUPTED, WALLTIME, ASKED = "save", "preempted", "interrupted", "walltime", "asked"
REQUESTS = (SAVE, PREEMPTED, INTERRUPTED, WALLTIME, ASKED)
# The reason a run stopped after an agreed request, in this order of precedence (an observer's: its own word).
STOP_REASONS = ((PREEMPTED, "preempted"), (WALLTIME, "walltime"))


@dataclass(frozen=True)
class Stop:
    """An observer's request to end the run after this step, saved (a requeue or --resume continues it).

    `reason`: one word for the metrics file's end record and the launcher's stop-reason file (a launcher requeues
    only after "walltime" or a preemption); `why`: the log's explanation."""

    reason: str
    why: str


@dataclass(frozen=True)
class Rollback:
    """An observer's request (from `judge`) to go back to the newest verified checkpoint; once done
    (after_rollback), where the run went back from and to, and what that checkpoint's observers saved."""

    why: str
    must: bool  # without a checkpoint to go back to, the run cannot go on (else: carry on, said)
    from_step: int = 0  # where the run was
    from_position: DataPosition = field(default_factory=DataPosition)
    tag: str = ""  # the checkpoint it went back to
    step: int = 0  # its step
    position: DataPosition = field(default_factory=DataPosition)
    saved: dict[str, dict[str, Any]] = field(default_factory=dict)  # the observers' states in that checkpoint


@dataclass(frozen=True)
class StepReport:
    """One step of the loop, for every observer: what a watchdog times, what a tracker logs."""

    step: int  # the optimizer step it ran; it stands only when `trained`
    outcome: str  # TRAINED, DISCARDED or ROLLED_BACK
    loss: float  # this rank's mean loss over the step's micro-batches; NaN when no update was applied
    lr: float  # the lr the step ran at
    grad_norm: float | None  # the engine's global gradient norm of an applied step, if it computed one
    data_wait_s: float  # of `seconds`, waiting for the step's batches
    seconds: float  # the whole step: data, forward, backward, optimizer step, the verdicts
    state: TrainState  # the loop's state after the step (a rollback's restored one): to read, never to change
    last: bool = False  # the run's last step (max_steps reached)
    trained_tokens: int = 0  # this rank's targets of the step (the loss's tokens)
    skipped_steps: int = 0  # optimizer steps the engine skipped (fp16 overflow), over the whole run
    phase_ms: dict[str, float] = field(default_factory=dict)  # the engine's wall-clock breakdown of the step
    sync_wait_s: float = 0.0  # of `seconds`, waiting for the other ranks in the step's collective
    # Every rank's step time split over the last --straggler_every steps, when this step's collective carried it
    rank_times: tuple[RankTimes, ...] | None = None
    # The requests every rank agreed on (REQUESTS), and what they decided: known at at_checkpoint (with one rank
    # the decision follows the step's observers and evaluations, which may ask for a stop)
    requests: frozenset[str] = frozenset()
    stop: str | None = None  # why the ranks agreed to stop after this step (saved), or None
    stopped_by: str | None = (
        None  # what asked for the stop on this rank: its signal's name, an observer's why
    )

    @property
    def trained(self) -> bool:
        return self.outcome == TRAINED

    @property
    def applied(self) -> bool:
        """The engine updated the weights in this step (it may have been rolled back since)."""
        return self.outcome in (TRAINED, ROLLED_BACK)


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    tag: str
    path: Path | None  # the verified tag dir on rank 0; None on the other ranks
    save_s: float  # writing, verifying and rotating, as the loop waited for it


class Observer:
    """Named points of the loop (the module docstring has their order); each one does nothing here."""

    name: ClassVar[str] = ""  # its state's key in a checkpoint; "" keeps none

    def state_dict(self) -> dict[str, Any]:
        return {}

    def on_start(self, state: TrainState) -> None:
        pass

    def takes(self, position: DataPosition) -> bool:
        return True

    def on_phase(self, phase: str, step: int) -> None:
        pass

    def before_step(self, step: int) -> None:
        pass

    def requests(self, step: int) -> set[str]:
        """What this rank asks of the step's collective (REQUESTS): every rank then acts on each asked anywhere."""
        return set()

    def keeps(self, step: int, loss: float) -> bool:
        """The step's loss over all ranks (the same on every rank), before the update: False discards the step."""
        return True

    def judge(self, report: StepReport) -> Rollback | None:
        """A step once it ran (applied: its grad norm known; or discarded): a Rollback to undo what led to it (the
        same on every rank); raising RunDiverged ends the run."""
        return None

    def after_rollback(self, rollback: Rollback) -> None:
        pass

    def after_step(self, report: StepReport) -> Stop | None:
        return None

    def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
        """The watchdog phase (observe/watchdog.py) of an evaluation this observer runs after trained step `step`
        (`last`: the run's last; `start`: before the first step instead), or None when it has none due. Every
        rank must answer alike."""
        return None

    def evaluate(self, step: int) -> Validation | None:
        """Run the evaluation evaluation_due named, on every rank (a sharded model's forward needs them all); a
        validation returns its result, which every observer gets (after_validation)."""
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        return None

    def after_evaluation(self, step: int, phase: str, seconds: float) -> None:
        """An evaluation (of any observer) ran at step `step`: its watchdog phase and wall seconds."""

    def at_checkpoint(self, report: StepReport) -> None:
        """The step's last point, after its evaluations: the checkpointer saves here when a save is due or asked."""

    def tags_in_use(self, tag: str) -> set[str]:
        """Local checkpoint tags this observer still reads (an upload in flight), `tag` (just saved, not yet
        handed to after_checkpoint_saved) included if it will: checkpoint rotation does not delete them."""
        return set()

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        pass

    def on_end(self, state: TrainState, reason: str) -> None:
        pass

    def on_close(self) -> None:
        """Release what the observer holds; runs on every exit path, after an error too. Idempotent."""


# The points called several times a step, each with the observers that do something there: a call of the base
# class's nothing costs as much as a real one (a few us, several a step).
_BUSY_POINTS = ("takes", "on_phase", "before_step", "requests", "keeps", "judge", "evaluation_due")


@dataclass
class Hooks:
    """The Trainer's one handle on its observers: each point calls them all, in order."""

    observers: Sequence[Observer] = ()
    stop: Stop | None = field(default=None, init=False)  # the first Stop asked for on this rank
    _acting: dict[str, tuple[Observer, ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.attach(self.observers)

    def attach(self, observers: Sequence[Observer]) -> None:
        """The observers, once built (they may hold these hooks: observers.build)."""
        self.observers = tuple(observers)
        self._acting = {
            point: tuple(o for o in self.observers if getattr(type(o), point) is not getattr(Observer, point))
            for point in _BUSY_POINTS
        }

    def acts(self, point: str) -> bool:
        """Whether any observer does something at `point` (the collective carries the loss only for `keeps`)."""
        return bool(self._acting[point])

    def _asked(self, request: Stop | None) -> None:
        if request is not None and self.stop is None:
            self.stop = request

    # --- state ---

    def state_dicts(self) -> dict[str, dict[str, Any]]:
        """Every named observer's state, by name: what a checkpoint keeps beside the TrainState."""
        return {o.name: o.state_dict() for o in self.observers if o.name}

    # --- the points ---

    def on_start(self, state: TrainState) -> None:
        for observer in self.observers:
            observer.on_start(state)

    def takes(self, position: DataPosition) -> bool:
        # In order, up to the first that passes over it: a later one does not count data an earlier one ruled out.
        return all(o.takes(position) for o in self._acting["takes"])

    def on_phase(self, phase: str, step: int) -> None:
        for observer in self._acting["on_phase"]:
            observer.on_phase(phase, step)

    def before_step(self, step: int) -> None:
        for observer in self._acting["before_step"]:
            observer.before_step(step)

    def requests(self, step: int) -> set[str]:
        asked = {ASKED} if self.stop is not None else set()
        return asked.union(*(o.requests(step) for o in self._acting["requests"]))

    def keeps(self, step: int, loss: float) -> bool:
        return all([o.keeps(step, loss) for o in self._acting["keeps"]])

    def judge(self, report: StepReport) -> Rollback | None:
        return next((r for o in self._acting["judge"] if (r := o.judge(report)) is not None), None)

    def after_rollback(self, rollback: Rollback) -> None:
        for observer in self.observers:
            observer.after_rollback(rollback)

    def after_step(self, report: StepReport) -> None:
        for observer in self.observers:
            self._asked(observer.after_step(report))

    def evaluate(self, step: int, last: bool = False, start: bool = False) -> None:
        for observer in self._acting["evaluation_due"]:
            phase = observer.evaluation_due(step, last, start)
            if phase is None:
                continue
            self.on_phase(phase, step)  # the watchdog allows an evaluation as long as a validation
            started = time.perf_counter()
            validation = observer.evaluate(step)
            seconds = time.perf_counter() - started
            if validation is not None:
                for told in self.observers:
                    self._asked(told.after_validation(step, validation))
            for told in self.observers:
                told.after_evaluation(step, phase, seconds)

    def stop_reason(self, requests: frozenset[str] | set[str]) -> str | None:
        """Why the ranks stop after a step whose agreed requests are these (the asking observer's reason on its
        rank; "observer" on the others), or None."""
        for request, reason in STOP_REASONS:
            if request in requests:
                return reason
        if ASKED in requests:
            return self.stop.reason if self.stop is not None else "observer"
        return None

    def at_checkpoint(self, report: StepReport) -> None:
        for observer in self.observers:
            observer.at_checkpoint(report)

    def tags_in_use(self, tag: str) -> set[str]:
        return set().union(*(observer.tags_in_use(tag) for observer in self.observers))

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        for observer in self.observers:
            observer.after_checkpoint_saved(saved)

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

"""An observer that writes down every point of the loop's seam it is called at (loop/hooks.py), and can ask to
stop at a given step: for the seam's tests, unit and through the real Trainer; and a real Trainer's observer of a
kind, found."""

from __future__ import annotations

from typing import Any, TypeVar

from model_utils.loop.hooks import Observer, Rollback, SavedCheckpoint, StepReport, Stop, Validation
from model_utils.loop.state import TrainState

Kind = TypeVar("Kind", bound=Observer)


def find(trainer: Any, kind: type[Kind]) -> Kind:
    """The trainer's observer of this kind (there is one)."""
    (found,) = [o for o in trainer.hooks.observers if isinstance(o, kind)]
    return found


class Recorder(Observer):
    """Writes down every point it is called at, with what identifies the call."""

    def __init__(self, label: str, calls: list[tuple[Any, ...]], stop_at: int | None = None) -> None:
        self.label, self.calls, self.stop_at = label, calls, stop_at
        self.reports: list[StepReport] = []

    def on_start(self, state: TrainState) -> None:
        self.calls.append((self.label, "on_start", state.step))

    def before_step(self, step: int) -> None:
        self.calls.append((self.label, "before_step", step))

    def after_step(self, report: StepReport) -> Stop | None:
        self.calls.append((self.label, "after_step", report.step, report.outcome))
        self.reports.append(report)
        if report.step == self.stop_at:
            return Stop("watchdog", f"step {report.step} took {report.seconds:.1f} s (a test)")
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        self.calls.append((self.label, "after_validation", step))
        return None

    def tags_in_use(self, tag: str) -> set[str]:
        self.calls.append((self.label, "tags_in_use", tag))
        return {f"{self.label}-keeps"}

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.calls.append((self.label, "after_checkpoint_saved", saved.step))

    def after_rollback(self, rollback: Rollback) -> None:
        self.calls.append((self.label, "after_rollback", rollback.step))

    def on_end(self, state: TrainState, reason: str) -> None:
        self.calls.append((self.label, "on_end", state.step, reason))

    def on_close(self) -> None:
        self.calls.append((self.label, "on_close"))

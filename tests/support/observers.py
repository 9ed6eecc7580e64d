"""An observer that writes down every point of the loop's seam it is called at (loop/hooks.py), and can ask to
stop at a given step: for the seam's tests, unit and through the real Trainer."""

from __future__ import annotations

from typing import Any

from model_utils.loop.hooks import GuardEvent, Observer, SavedCheckpoint, StepReport, Stop, Validation
from model_utils.loop.state import TrainState


class Recorder(Observer):
    """Writes down every point it is called at, with what identifies the call."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]], stop_at: int | None = None) -> None:
        self.name, self.calls, self.stop_at = name, calls, stop_at
        self.reports: list[StepReport] = []

    def on_start(self, state: TrainState) -> None:
        self.calls.append((self.name, "on_start", state.step))

    def before_step(self, step: int) -> None:
        self.calls.append((self.name, "before_step", step))

    def after_step(self, report: StepReport) -> Stop | None:
        self.calls.append((self.name, "after_step", report.step, report.outcome))
        self.reports.append(report)
        if report.step == self.stop_at:
            return Stop("watchdog", f"step {report.step} took {report.seconds:.1f} s (a test)")
        return None

    def after_validation(self, step: int, validation: Validation) -> Stop | None:
        self.calls.append((self.name, "after_validation", step))
        return None

    def tags_in_use(self, tag: str) -> set[str]:
        self.calls.append((self.name, "tags_in_use", tag))
        return {f"{self.name}-keeps"}

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.calls.append((self.name, "after_checkpoint_saved", saved.step))

    def on_guard_event(self, event: GuardEvent) -> None:
        self.calls.append((self.name, "on_guard_event", event.kind))

    def on_end(self, state: TrainState, reason: str) -> None:
        self.calls.append((self.name, "on_end", state.step, reason))

    def on_close(self) -> None:
        self.calls.append((self.name, "on_close"))

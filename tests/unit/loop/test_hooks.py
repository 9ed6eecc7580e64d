"""The loop's observer seam (model_utils/loop/hooks.py): each point calls every observer in order, a Stop, a
Rollback and the requests come back typed, the first observer to pass over data ends the asking, the named ones'
states go out and come back by name, a failing observer's error is not swallowed, a step's report says what became
of it. Through the real
Trainer (the order a run meets the points, an observer's stop, a failing observer): tests/e2e/test_hooks.py."""

from __future__ import annotations

import time
from typing import Any

import pytest

from model_utils.data.sampler import DataPosition
from model_utils.loop import hooks
from model_utils.loop.hooks import Hooks, Observer, Rollback, SavedCheckpoint, StepReport, Stop, Validation
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog
from model_utils.observe.metrics import Score
from support.observers import Recorder

VALIDATION = Validation(Score(2.5 * 508, 508, 2032), blocks=4, total_blocks=4, seconds=0.25)


class Validates(Observer):
    """A validation due after every step, its result VALIDATION."""

    def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
        return watchdog.VALIDATION

    def evaluate(self, step: int) -> Validation:
        return VALIDATION


def report(step: int, outcome: str = hooks.TRAINED) -> StepReport:
    return StepReport(step, outcome, 1.0, 1e-3, 0.5, 0.01, 0.2, TrainState(step=step))


def test_each_point_calls_every_observer_in_order() -> None:
    calls: list[tuple[Any, ...]] = []
    seam = Hooks([Validates(), Recorder("a", calls), Recorder("b", calls)])
    state = TrainState(step=4)
    seam.on_start(state)
    seam.before_step(5)
    seam.after_rollback(Rollback("a test", must=False, step=4))
    seam.after_step(report(5))
    seam.evaluate(5)  # the validation's result goes to everyone
    assert seam.tags_in_use("t-5steps") == {"a-keeps", "b-keeps"}
    seam.after_checkpoint_saved(SavedCheckpoint(5, "t-5steps", None, 0.1))
    seam.on_end(state, "done")
    seam.on_close()
    points = [
        ("on_start", 4),
        ("before_step", 5),
        ("after_rollback", 4),
        ("after_step", 5, "trained"),
        ("after_validation", 5),
        ("tags_in_use", "t-5steps"),
        ("after_checkpoint_saved", 5),
        ("on_end", 4, "done"),
        ("on_close",),
    ]
    assert calls == [(name, *point) for point in points for name in ("a", "b")]
    assert seam.stop is None


def test_the_points_of_every_step_skip_the_observers_that_do_nothing_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """on_phase, before_step and evaluation_due run several times a step: an observer that leaves them to the base
    class is not called there (each call costs as much as a real one)."""
    calls: list[tuple[Any, ...]] = []

    class Quiet(Observer):
        def after_step(self, report: StepReport) -> Stop | None:
            calls.append(("quiet after_step", report.step))
            return None

    class Phases(Observer):
        def on_phase(self, phase: str, step: int) -> None:
            calls.append(("phases on_phase", phase, step))

        def before_step(self, step: int) -> None:
            calls.append(("phases before_step", step))

    seam = Hooks([Quiet(), Phases()])

    def base_called(*args: Any) -> None:
        calls.append(("base", *args[1:]))

    for point in ("on_phase", "before_step", "evaluation_due"):
        monkeypatch.setattr(Observer, point, base_called)
    seam.on_phase(watchdog.COMPUTE, 5)
    seam.before_step(5)
    seam.evaluate(5, last=False)
    seam.after_step(report(5))
    assert calls == [
        ("phases on_phase", watchdog.COMPUTE, 5),
        ("phases before_step", 5),
        ("quiet after_step", 5),
    ]


def test_the_first_stop_asked_for_is_kept() -> None:
    class Early(Observer):
        def after_validation(self, step: int, validation: Validation) -> Stop | None:
            return Stop("early_stop", f"validation loss {validation.loss} stopped improving")

    calls: list[tuple[Any, ...]] = []
    seam = Hooks([Recorder("a", calls, stop_at=3), Early(), Validates()])
    seam.after_step(report(2))
    assert seam.stop is None
    seam.after_step(report(3))
    assert seam.stop == Stop("watchdog", "step 3 took 0.2 s (a test)")
    seam.evaluate(3)  # Early asks too: the first one asked is kept
    assert seam.stop.reason == "watchdog"
    assert Hooks([Early()]).stop is None  # each Hooks its own


def test_an_observers_error_is_not_swallowed_and_close_closes_the_others_first() -> None:
    boom = RuntimeError("boom")

    class Failing(Observer):
        def after_step(self, report: StepReport) -> Stop | None:
            raise boom

        def on_close(self) -> None:
            raise boom

    calls: list[tuple[Any, ...]] = []
    seam = Hooks([Failing(), Recorder("after", calls)])
    with pytest.raises(RuntimeError) as raised:
        seam.after_step(report(1))
    assert raised.value is boom and calls == []  # the point stops at the error, as a direct call would
    with pytest.raises(RuntimeError) as raised:
        seam.on_close()
    assert raised.value is boom and calls == [("after", "on_close")]


def test_report_says_whether_an_update_was_applied_and_stands() -> None:
    assert report(1).trained and report(1).applied
    rolled_back = report(1, hooks.ROLLED_BACK)
    assert rolled_back.applied and not rolled_back.trained
    discarded = report(1, hooks.DISCARDED)
    assert not discarded.applied and not discarded.trained


def test_the_hooks_tell_the_watchdog_of_the_phase_before_the_evaluation_and_everyone_its_time_after() -> None:
    calls: list[tuple[Any, ...]] = []

    class Due(hooks.Observer):
        def evaluation_due(self, step: int, last: bool, start: bool = False) -> str | None:
            return watchdog.SAMPLES if last else None

        def evaluate(self, step: int) -> None:
            calls.append(("evaluate", step))
            time.sleep(0.01)

    class Phases(hooks.Observer):
        def on_phase(self, phase: str, step: int) -> None:
            calls.append(("on_phase", phase, step))

        def after_evaluation(self, step: int, phase: str, seconds: float) -> None:
            calls.append(("after_evaluation", step, phase, seconds >= 0.01))

    seam = hooks.Hooks([Phases(), Due()])
    seam.evaluate(4, last=False)
    assert calls == []
    seam.evaluate(5, last=True)
    assert calls == [
        ("on_phase", watchdog.SAMPLES, 5),
        ("evaluate", 5),
        ("after_evaluation", 5, watchdog.SAMPLES, True),
    ]


def test_the_first_observer_to_pass_over_data_ends_the_asking() -> None:
    asked: list[str] = []

    class Passes(Observer):
        def __init__(self, label: str, takes: bool) -> None:
            self.label, self.answer = label, takes

        def takes(self, position: DataPosition) -> bool:
            asked.append(self.label)
            return self.answer

    assert Hooks([Passes("a", True), Passes("b", True)]).takes(DataPosition())
    assert asked == ["a", "b"]
    asked.clear()
    # A later observer does not count data an earlier one ruled out (a test's fault, after the spike guard).
    assert not Hooks([Passes("a", False), Passes("b", True)]).takes(DataPosition())
    assert asked == ["a"]


def test_the_requests_verdicts_and_stop_reasons_come_back_typed() -> None:
    class Asks(Observer):
        def requests(self, step: int) -> set[str]:
            return {hooks.SAVE} if step == 2 else set()

        def keeps(self, step: int, loss: float) -> bool:
            return loss < 10

        def judge(self, report: StepReport) -> Rollback | None:
            return Rollback("a spike", must=True) if report.grad_norm and report.grad_norm > 1 else None

    seam = Hooks([Asks(), Recorder("r", [], stop_at=3)])
    assert seam.acts("keeps") and not Hooks([Recorder("r", [])]).acts("keeps")
    assert seam.requests(1) == set() and seam.requests(2) == {hooks.SAVE}
    assert seam.keeps(1, 2.0) and not seam.keeps(1, 12.0)
    assert seam.judge(report(1)) is None
    assert seam.judge(StepReport(1, hooks.TRAINED, 1.0, 1e-3, 5.0, 0.0, 0.1, TrainState())) == Rollback(
        "a spike", must=True
    )
    seam.after_step(report(3))  # the recorder asks to stop: every later collective carries it
    assert seam.requests(4) == {hooks.ASKED}
    assert seam.stop_reason({hooks.ASKED}) == "watchdog"
    assert Hooks([]).stop_reason({hooks.ASKED}) == "observer"  # asked on another rank
    assert seam.stop_reason({hooks.PREEMPTED, hooks.WALLTIME, hooks.ASKED}) == "preempted"
    assert seam.stop_reason({hooks.WALLTIME, hooks.ASKED}) == "walltime"
    assert seam.stop_reason({hooks.SAVE}) is None


def test_named_observers_states_go_into_the_checkpoint_by_name() -> None:
    class Counts(Observer):
        name = "counts"

        def __init__(self) -> None:
            self.seen = 0

        def state_dict(self) -> dict[str, Any]:
            return {"seen": self.seen}

    counts = Counts()
    counts.seen = 7
    seam = Hooks([counts, Recorder("unnamed", [])])
    assert seam.state_dicts() == {"counts": {"seen": 7}}  # an observer without a name keeps nothing

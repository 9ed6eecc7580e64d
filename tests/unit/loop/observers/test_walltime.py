"""The time-limit observer's say in the step's collective, its line and its record of save times; the planner's
arithmetic: tests/unit/launch/test_walltime.py; a run that stops at its time limit: tests/e2e/test_trainer.py."""

from __future__ import annotations

from types import SimpleNamespace

from model_utils.launch import walltime
from model_utils.loop.hooks import SAVE, TRAINED, WALLTIME, SavedCheckpoint, StepReport
from model_utils.loop.observers.walltime import Walltime
from model_utils.loop.state import TrainState


def observer(left_s: float, step_s: float = 10.0) -> Walltime:
    """A job with `left_s` seconds left, at `step_s` a step, checkpoints every 50 steps of 100."""
    now = [1000.0]
    planner = walltime.WalltimePlanner(lambda: now[0] + left_s, lambda: now[0])
    return Walltime(planner, SimpleNamespace(step_time=lambda: step_s), checkpoint_freq=50, max_steps=100)  # type: ignore[arg-type]


def report(step: int, stop: str | None = None) -> StepReport:
    return StepReport(step, TRAINED, 1.0, 1e-3, None, 0.0, 1.0, TrainState(step=step), stop=stop)


def test_plenty_of_time_asks_nothing_and_the_start_says_the_limit(capsys) -> None:
    w = observer(left_s=10_000.0)
    w.on_start(TrainState())
    assert "Job time limit: 2:46:40 left" in capsys.readouterr().out
    assert w.requests(1) == set()


def test_a_checkpoint_due_after_the_limit_asks_for_an_early_save_once_and_says_why(capsys) -> None:
    w = observer(left_s=400.0)  # the save at step 50 would land 490 s on
    assert w.requests(1) == {SAVE}
    w.at_checkpoint(report(1))
    assert "Saving early at step 1" in capsys.readouterr().out
    assert w.requests(2) == set()  # once


def test_too_little_time_for_another_step_asks_to_stop_and_saves_count_in_the_plan(capsys) -> None:
    w = observer(left_s=400.0)
    w.after_checkpoint_saved(
        SavedCheckpoint(1, "t-1steps", None, 395.0)
    )  # a slow save: it must fit at the end
    assert WALLTIME in w.requests(1)
    w.at_checkpoint(report(1, stop="walltime"))
    assert "Saving early" not in capsys.readouterr().out  # a stop's save is no early one


def test_only_rank_0_plans() -> None:
    ctx = SimpleNamespace(dist=SimpleNamespace(is_main=False))
    assert Walltime.from_loop(ctx) is None  # type: ignore[arg-type]

"""Walltime planning against a job end time: when to save early and when to save and stop.

The end time and the clock are fakes here (a unit test of the decision); the real `squeue` read is exercised
by the SLURM tests, which submit with a time limit and check the logged time left.
"""

from __future__ import annotations

import pytest

from model_utils.launch import walltime
from model_utils.launch.walltime import Decision, WalltimePlanner


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def planner(end_in: float | None, clock: FakeClock) -> WalltimePlanner:
    end_time = None if end_in is None else clock.now + end_in
    return WalltimePlanner(end_time_source=lambda: end_time, clock=clock)


def test_no_time_limit_never_interferes() -> None:
    clock = FakeClock()
    assert planner(None, clock).decide(step=5, step_time=10.0, next_checkpoint_step=1000) == Decision()
    assert planner(None, clock).remaining() is None


def test_plenty_of_time_changes_nothing() -> None:
    clock = FakeClock()
    plan = planner(10_000.0, clock)
    assert plan.decide(step=10, step_time=1.0, next_checkpoint_step=50) == Decision()


def test_saves_early_once_when_the_next_checkpoint_would_land_too_late() -> None:
    clock = FakeClock()
    plan = planner(1000.0, clock)
    plan.record_save(30.0)  # reserve: 30 s save + 60 s margin
    # next checkpoint in 950 steps x 1 s: lands after end - reserve
    assert plan.decide(step=50, step_time=1.0, next_checkpoint_step=1000) == Decision(save_now=True)
    clock.now += 1.0
    assert (
        plan.decide(step=51, step_time=1.0, next_checkpoint_step=1000) == Decision()
    )  # once, not every step
    assert plan.early_save_step == 50


def test_stops_when_one_more_step_would_eat_into_the_save_reserve() -> None:
    clock = FakeClock()
    plan = planner(1000.0, clock)
    plan.record_save(30.0)
    clock.now += 1000.0 - 92.0  # 92 s left: one 5 s step leaves 87 s < 30 + 60
    assert plan.decide(step=7, step_time=5.0, next_checkpoint_step=10) == Decision(stop_now=True)


def test_reserve_uses_the_slowest_save_and_at_least_two_steps() -> None:
    plan = planner(None, FakeClock())
    assert plan.reserve(step_time=1.0) == walltime.FIRST_SAVE_GUESS_S + walltime.MIN_MARGIN_S
    plan.record_save(40.0)
    plan.record_save(10.0)
    assert plan.reserve(step_time=1.0) == 40.0 + walltime.MIN_MARGIN_S
    assert plan.reserve(step_time=100.0) == 40.0 + 200.0


def test_end_time_is_re_read_every_few_minutes() -> None:
    """An admin extending the limit (scontrol update TimeLimit=...) is seen within REFRESH_S."""
    clock = FakeClock()
    ends = iter([clock.now + 100.0, clock.now + 5000.0])
    plan = WalltimePlanner(end_time_source=lambda: next(ends), clock=clock)
    assert plan.remaining() == pytest.approx(100.0)
    clock.now += walltime.REFRESH_S
    assert plan.remaining() == pytest.approx(5000.0 - walltime.REFRESH_S)


def test_outside_slurm_there_is_no_end_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert walltime.slurm_end_time() is None

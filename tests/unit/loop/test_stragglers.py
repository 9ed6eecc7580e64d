"""The straggler report's verdict (loop/stragglers.py): a rank's window of turns split into data, compute and
wait; a rank busier than the median by more than the threshold in PERSISTENCE windows in a row is named once;
noise and a single slow window name nobody; 1,000 clean steps of a real-looking spread name nobody."""

from __future__ import annotations

import random

import pytest

from model_utils.loop.stragglers import PERSISTENCE, RankTimes, StepTimes, StragglerJudge


def test_a_window_of_turns_splits_into_data_compute_and_wait() -> None:
    window = StepTimes()
    window.add(data_s=0.1, sync_s=0.3, total_s=1.0)
    window.add(data_s=0.0, sync_s=0.1, total_s=1.2)
    assert window.turns == 2
    times = window.take()
    assert (times.data_s, times.compute_s, times.sync_s) == pytest.approx((0.1, 1.7, 0.4))
    assert times.busy_s == pytest.approx(1.8)
    assert window.turns == 0 and window.take() == RankTimes(0.0, 0.0, 0.0)


def window(busy: list[float]) -> tuple[RankTimes, ...]:
    """Synchronized ranks: each waits for the busiest one."""
    slowest = max(busy)
    return tuple(RankTimes(0.05 * b, 0.95 * b, slowest - b) for b in busy)


def test_a_persistently_slow_rank_is_named_once_and_a_slow_window_is_not() -> None:
    judge = StragglerJudge(threshold=0.1)
    # A single slow window (a page cache flush) is no straggler.
    assert judge.judge(20, window([1.0, 1.0, 1.5, 1.0])).stragglers == ()
    assert judge.judge(40, window([1.0, 1.0, 1.0, 1.0])).stragglers == ()
    named = [judge.judge(40 + 20 * i, window([1.0, 1.2, 1.0, 1.01])) for i in range(1, PERSISTENCE + 2)]
    assert [s.slow for s in named] == [(1,)] * (PERSISTENCE + 1)
    assert [s.newly_named for s in named] == [()] * (PERSISTENCE - 1) + [
        (1,),
        (),
    ]  # one warning, not one per window
    spread = named[-1]
    assert spread.stragglers == (1,) and spread.spread == pytest.approx(1.2)
    record = spread.record(window([1.0, 1.2, 1.0, 1.01]))
    assert record["slowest_rank"] == 1 and record["stragglers"] == [1] and len(record["sync_s"]) == 4


def test_with_two_ranks_the_slower_one_is_measured_against_the_faster() -> None:
    judge = StragglerJudge(threshold=0.1)
    spreads = [judge.judge(i, window([1.0, 1.2])) for i in range(PERSISTENCE)]
    assert spreads[-1].stragglers == (1,)  # the mean of two (1.1) would hide a 20% slower rank


def test_a_thousand_clean_steps_name_nobody() -> None:
    """Clean ranks differ by a few percent per step (noise, rank 0's logging): over windows of 20 turns and 8
    ranks, 1,000 steps (50 windows) name nobody."""
    rng = random.Random(0)
    judge = StragglerJudge(threshold=0.1)
    for step in range(20, 1001, 20):
        busy = [sum(rng.gauss(0.1, 0.01) for _ in range(20)) * (1.02 if r == 0 else 1.0) for r in range(8)]
        assert judge.judge(step, window(busy)).stragglers == ()

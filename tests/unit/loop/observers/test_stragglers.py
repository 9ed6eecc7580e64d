"""The straggler report at the loop's points, over a stand-in reporter: a turn whose collective carried the
ranks' times becomes a metrics record and tracker points; a rank slow PERSISTENCE comparisons in a row is named
in one warning line, once; turns without times report nothing. The verdict itself:
tests/unit/loop/test_stragglers.py; in a real run: tests/e2e/test_stragglers.py."""

from __future__ import annotations

from typing import Any

import pytest

from model_utils.loop import hooks
from model_utils.loop.hooks import StepReport
from model_utils.loop.observers.stragglers import Stragglers
from model_utils.loop.state import TrainState
from model_utils.loop.stragglers import PERSISTENCE, RankTimes, StragglerJudge


class Reporter:
    def __init__(self) -> None:
        self.measured_calls: list[tuple[dict[str, Any], dict[str, float]]] = []

    def measured(self, record: dict[str, Any], tracked: dict[str, float]) -> None:
        self.measured_calls.append((record, tracked))


def report(step: int, times: tuple[RankTimes, ...] | None) -> StepReport:
    return StepReport(
        step, hooks.TRAINED, 2.5, 1e-3, 0.7, 0.01, 0.2, None, TrainState(step=step), rank_times=times
    )


def test_a_slow_rank_is_named_once_and_every_comparison_is_recorded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    reporter = Reporter()
    observer = Stragglers(StragglerJudge(0.1), reporter)  # type: ignore[arg-type]
    slow = (RankTimes(0.1, 1.0, 0.3), RankTimes(0.1, 1.3, 0.0))
    assert observer.after_step(report(20, None)) is None  # no comparison in this turn
    assert reporter.measured_calls == []
    for i in range(PERSISTENCE + 1):
        assert observer.after_step(report(21 + 20 * i, slow)) is None
    warnings = [line for line in capsys.readouterr().out.splitlines() if "Straggler" in line]
    assert len(warnings) == 1, warnings
    assert "WARNING: Straggler: rank 1 is 27% slower than the median rank" in warnings[0]
    assert "busy 1.400 s against 1.100 s: data 0.100 s, compute 1.300 s" in warnings[0]
    assert len(reporter.measured_calls) == PERSISTENCE + 1
    record, tracked = reporter.measured_calls[-1]
    assert record["event"] == "stragglers" and record["stragglers"] == [1] and record["slowest_rank"] == 1
    assert tracked == {"straggler/spread": pytest.approx(1.4 / 1.1), "straggler/count": 1.0}
    first, _ = reporter.measured_calls[0]
    assert first["stragglers"] == [] and first["step"] == 21

"""The hang watchdog at the loop's points: the phases the loop enters and the steps it takes reach the monitor,
which starts with the loop and stops (its heartbeat gone) at its end; off with --hang_timeout 0. The monitor
itself: tests/unit/observe/test_watchdog.py; in a real run: tests/e2e/test_hang.py."""

from __future__ import annotations

from pathlib import Path

from model_utils.loop import hooks
from model_utils.loop.hooks import StepReport
from model_utils.loop.observers.watchdog import Watchdog
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog
from model_utils.observe.watchdog import Monitor


def report(step: int, outcome: str, seconds: float) -> StepReport:
    return StepReport(step, outcome, 2.5, 1e-3, 0.7, 0.01, seconds, TrainState(step=step))


def test_the_loops_points_reach_the_monitor(tmp_path: Path) -> None:
    exits: list[int] = []
    monitor = Monitor(0, 30, directory=tmp_path / "beats", exit=exits.append)
    observer = Watchdog(monitor)
    observer.on_start(TrainState(step=4))  # a resumed run: its next step is 5
    assert monitor.beats()[0].position() == (5, watchdog.PHASES.index(watchdog.DATA))
    observer.before_step(5)
    assert monitor._progress[:2] == (5, watchdog.COMPUTE)
    observer.on_phase(watchdog.CHECKPOINT, 5)  # a long phase: written at once, not at the thread's next round
    assert [(b.step, b.phase) for b in monitor.beats()] == [(5, watchdog.CHECKPOINT)]
    observer.after_step(report(5, hooks.TRAINED, 0.4))
    observer.after_step(report(6, hooks.DISCARDED, 9.0))  # no update applied: not a step time
    assert monitor.step_median() == 0.4
    observer.on_end(TrainState(step=6), "done")
    assert monitor.beats() == [] and not (tmp_path / "beats").exists()
    observer.on_close()  # idempotent
    assert exits == []

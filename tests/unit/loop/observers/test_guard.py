"""The spike guard observer between the loop and the guard's judgement (spike_guard.py: its arithmetic,
tests/unit/loop/test_spike_guard.py): a spiking loss is not kept, a discarded step is said and recorded, skips in a
row roll back or stop, a rollback's data is passed over once (said), and its state travels by name. In real runs
with injected faults: tests/e2e/test_guarded_runs.py."""

from __future__ import annotations

import math

import pytest

from model_utils.config.arguments import GuardArgs
from model_utils.data.sampler import DataPosition
from model_utils.errors import RunDiverged
from model_utils.loop import spike_guard
from model_utils.loop.hooks import DISCARDED, TRAINED, Rollback, StepReport
from model_utils.loop.observers.guard import Guard
from model_utils.loop.state import TrainState


class Reporter:
    def __init__(self) -> None:
        self.events: list[dict] = []

    def measured(self, record: dict, counters: dict) -> None:
        self.events.append({**record, **counters})


def observer(mode: str = "rollback", skips: int = 2) -> tuple[Guard, Reporter]:
    args = GuardArgs(
        spike_guard=mode,
        spike_window=4,
        spike_warmup_steps=0,
        spike_loss_ratio=1.0,
        spike_grad_norm_ratio=1.0,
        max_consecutive_skips=skips,
    )
    reporter = Reporter()
    return Guard(spike_guard.SpikeGuard(args, mode), reporter), reporter  # type: ignore[arg-type]


def run_step(guard: Guard, step: int, loss: float, consumed: int) -> tuple[bool, Rollback | None]:
    """One step as the loop meets the guard: takes, before_step, keeps, judge."""
    assert guard.takes(DataPosition(0, consumed))
    guard.before_step(step)
    kept = guard.keeps(step, loss)
    outcome = TRAINED if kept else DISCARDED
    loss_seen = loss if kept else math.nan
    report = StepReport(
        step, outcome, loss_seen, 1e-3, 1.0 if kept else None, 0.0, 1.0, TrainState(step=step)
    )
    return kept, guard.judge(report)


def warm(guard: Guard) -> None:
    for step, loss in enumerate((3.0, 2.9, 3.1, 3.0), start=1):
        assert run_step(guard, step, loss, step - 1) == (True, None)


def test_a_spike_is_not_kept_said_and_recorded_and_skips_in_a_row_roll_back(capsys) -> None:
    guard, reporter = observer("rollback", skips=2)
    warm(guard)
    assert run_step(guard, 5, 9.0, 4) == (False, None)
    assert "Spike guard: skipped step 5" in capsys.readouterr().out
    assert reporter.events[-1]["event"] == spike_guard.SPIKE_SKIP and reporter.events[-1]["step"] == 5
    kept, rollback = run_step(guard, 5, 9.0, 5)
    assert not kept and rollback is not None and rollback.must and "2 loss spikes in a row" in rollback.why


def test_skip_mode_stops_the_run_after_skips_in_a_row() -> None:
    guard, _ = observer("skip", skips=2)
    warm(guard)
    run_step(guard, 5, 9.0, 4)
    with pytest.raises(RunDiverged, match="2 steps in a row skipped as loss spikes"):
        run_step(guard, 5, 9.0, 5)


def test_after_a_rollback_its_data_is_passed_over_once_said_and_the_state_travels_by_name(capsys) -> None:
    guard, reporter = observer("rollback", skips=1)
    warm(guard)
    kept, rollback = run_step(guard, 5, 9.0, 4)
    assert not kept and rollback is not None
    saved = {"spike_guard": {"loss_window": [3.0] * 4, "grad_window": [1.0] * 4}}
    done = Rollback(
        rollback.why, rollback.must, from_step=4, from_position=DataPosition(0, 5), tag="t-2steps", step=2,
        position=DataPosition(0, 2), saved=saved,
    )  # fmt: skip
    guard.after_rollback(done)
    assert "rolled back from step 4 to step 2 (t-2steps)" in capsys.readouterr().out
    assert (
        reporter.events[-1]["event"] == spike_guard.ROLLBACK
        and reporter.events[-1]["spike_guard/rollbacks"] == 1
    )
    # The data since the checkpoint (up to --rollback_skip_steps before the spike) is passed over once, said.
    assert [guard.takes(DataPosition(0, consumed)) for consumed in (2, 3, 4)] == [False] * 3
    assert guard.takes(DataPosition(0, 5))
    assert "skipped 3 steps of data from epoch 0 block 2" in capsys.readouterr().out
    again, _ = observer("rollback", skips=1)
    again.guard.load_state_dict(guard.state_dict())
    assert (
        Guard.name == "spike_guard"
        and not again.takes(DataPosition(0, 4))
        and again.takes(DataPosition(0, 5))
    )

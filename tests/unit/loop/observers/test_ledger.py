"""The ledger observer's records at the loop's points (what `dskit cost` reads: tests/unit/dskit/cost), and what
it learns of the attempt: the launch time, the host's instance type, SLURM's submit time."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

from dskit import cost
from model_utils.loop.hooks import DISCARDED, ROLLED_BACK, TRAINED, Rollback, SavedCheckpoint, StepReport
from model_utils.loop.observers import ledger
from model_utils.loop.state import TrainState
from model_utils.observe import watchdog
from model_utils.observe.metrics import Score, Validation


def report(step: int, outcome: str = TRAINED, seconds: float = 0.01) -> StepReport:
    return StepReport(step, outcome, 1.0, 1e-3, None, 0.0, seconds, TrainState(step=step))


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_run_writes_start_steps_validation_evaluation_checkpoint_rollback_end_and_closed(
    tmp_path: Path,
) -> None:
    path = tmp_path / ledger.LEDGER
    book = ledger.Ledger(path, {"launched_at": time.time() - 3, "nodes": 1, "step": 0, "tokens_per_step": 64})
    book.on_start(TrainState())
    book.after_step(report(1))
    book.after_step(report(2, DISCARDED))  # its step is retried: the trained run stays 1..2
    book.after_step(report(2))
    book.after_validation(2, Validation(Score(128.0, 128, 512), blocks=4, total_blocks=4, seconds=0.5))
    book.after_evaluation(2, watchdog.SAMPLES, 0.125)
    book.after_evaluation(2, watchdog.VALIDATION, 0.5)  # its own record above: not twice
    book.after_checkpoint_saved(SavedCheckpoint(2, "t-2steps", tmp_path, 0.25))
    book.after_step(report(3))
    # Step 4's verdict took the run back to step 2 before its report (the loop's order).
    book.after_rollback(Rollback("spikes", must=False, from_step=4, tag="t-2steps", step=2))
    book.after_step(report(4, ROLLED_BACK))
    book.on_end(TrainState(step=4), "done")
    book.on_close()
    book.on_close()  # idempotent
    got = records(path)
    assert [r["event"] for r in got] == [
        "start", "steps", "validation", "evaluation", "checkpoint", "steps", "rollback", "steps", "end", "closed",
    ]  # fmt: skip
    steps = got[1]
    assert (steps["first"], steps["last"], steps["trained"], steps["untrained"]) == (1, 2, 2, 1)
    assert steps["trained_s"] == pytest.approx(0.02) and steps["untrained_s"] == pytest.approx(0.01)
    assert got[3] == {**got[3], "step": 2, "phase": "samples", "seconds": 0.125}
    assert got[4]["seconds"] == 0.25 and got[6] == {**got[6], "from_step": 4, "to_step": 2}
    assert (got[5]["last"], got[7]["trained"], got[7]["untrained"]) == (3, 0, 1)  # step 4's time, untrained
    assert got[8]["reason"] == "done" and all(a["t"] <= b["t"] for a, b in itertools.pairwise(got))
    # What dskit cost makes of it: step 3 is trained again (a rollback's waste), step 4 trained nothing, 1-2 stand.
    acct = cost.account(got)
    assert acct.trained_steps == 2 and acct.attempts[0].seconds["rollbacks"] == pytest.approx(0.01)
    assert acct.attempts[0].seconds["discarded"] == pytest.approx(0.02)
    assert acct.attempts[0].seconds["samples"] == 0.125


def test_steps_are_written_every_interval_so_a_crash_loses_little(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ledger, "STEPS_EVERY_S", 0.0)
    book = ledger.Ledger(tmp_path / ledger.LEDGER, {"launched_at": 0.0})
    book.on_start(TrainState())
    book.after_step(report(1))
    book.after_step(report(2))
    assert [r.get("last") for r in records(tmp_path / ledger.LEDGER)] == [None, 1, 2]  # start, then each turn

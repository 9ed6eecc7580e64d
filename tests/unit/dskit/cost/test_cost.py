"""dskit cost on synthetic ledgers: every second of each attempt lands in one cause, steps trained again are
waste of the attempt that first trained them, and the money is node-hours x the price."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dskit import cost
from dskit.cli import main as dskit_main
from model_utils.errors import ConfigError


def start(t: float, step: int = 0, nodes: int = 2, submitted: float | None = None, **extra) -> dict:
    job = {"scheduler": "slurm", "id": "7", "submitted_at": submitted}
    return {"event": "start", "t": t + 5, "launched_at": t, "job": job, "nodes": nodes, "step": step,
            "tokens_per_step": 1000, "instance_type": "p5.48xlarge", **extra}  # fmt: skip


def steps(t: float, first: int, last: int, seconds: float, started: float, untrained_s: float = 0.0) -> dict:
    return {"event": "steps", "t": t, "started_at": started, "first": first, "last": last,
            "trained": last - first + 1, "trained_s": seconds, "untrained": 0, "untrained_s": untrained_s}  # fmt: skip


def two_attempts() -> list[dict]:
    """Attempt 1: 20 s start-up, steps 1-10 (1 s each), a save at 10 (3 s), steps 11-14, then killed (no end).
    Attempt 2 resumes at step 10: steps 11-14 are trained again, then 11-20, a save, the end."""
    return [
        start(1000.0, submitted=900.0),
        steps(1030.0, 1, 10, 10.0, started=1020.0),
        {"event": "checkpoint", "t": 1033.0, "step": 10, "seconds": 3.0},
        steps(1037.0, 11, 14, 4.0, started=1033.0),
        start(1100.0, step=10, submitted=900.0),
        {"event": "validation", "t": 1112.0, "step": 10, "seconds": 2.0},
        {"event": "evaluation", "t": 1113.5, "step": 10, "phase": "samples", "seconds": 1.5},
        {"event": "evaluation", "t": 1114.0, "step": 10, "phase": "a_future_one", "seconds": 0.5},  # in other
        # Not validation's, though its phase has that name:
        {"event": "evaluation", "t": 1114.5, "step": 10, "phase": "validation", "seconds": 0.5},
        steps(1130.0, 11, 20, 10.0, started=1120.0, untrained_s=1.0),
        {"event": "checkpoint", "t": 1134.0, "step": 20, "seconds": 4.0},
        {"event": "end", "t": 1134.5, "step": 20, "reason": "done"},
        {"event": "exit", "t": 1135.0},
    ]


def test_each_attempt_splits_its_wall_time_by_cause_and_repeated_steps_are_the_first_attempts_waste() -> None:
    acct = cost.account(two_attempts())
    first, second = acct.attempts
    assert first.wall_s == 37.0 and first.ended == "crashed"  # to its last record
    assert second.wall_s == 35.0 and second.ended == "done"
    assert first.seconds["startup"] == 20.0 and second.seconds["startup"] == 20.0
    assert first.seconds["productive"] == 10.0 and first.seconds["restarts"] == 4.0  # steps 11-14 again later
    assert second.seconds["productive"] == 10.0 and second.seconds["restarts"] == 0.0
    assert second.seconds["validation"] == 2.0 and second.seconds["discarded"] == 1.0
    assert second.seconds["samples"] == 1.5 and first.seconds["samples"] == 0.0
    for attempt in acct.attempts:  # every second in exactly one cause
        assert sum(attempt.seconds.values()) == pytest.approx(attempt.wall_s)
    assert acct.trained_steps == 20 and acct.tokens == 20_000
    assert acct.goodput == pytest.approx(20.0 / 72.0)  # two nodes each attempt: the ratio is per node-second
    assert acct.node_seconds() == 2 * 72.0
    assert [a.queue_s for a in acct.attempts] == [100.0, 63.0]  # the requeue waited from the first's end


def test_steps_a_resume_proves_trained_stand_though_the_attempt_ended_before_recording_them() -> None:
    """Attempt 1 saved at step 15 and was killed before its steps record for 11-15: attempt 2 resumes at 15, so
    those steps stand (the run trained 20), their time in attempt 1's "other" (no record says how long)."""
    records = [
        start(1000.0),
        steps(1030.0, 1, 10, 10.0, started=1020.0),
        {"event": "checkpoint", "t": 1040.0, "step": 15, "seconds": 3.0},
        start(1100.0, step=15),
        steps(1130.0, 16, 20, 5.0, started=1125.0),
        {"event": "end", "t": 1131.0, "step": 20, "reason": "done"},
    ]
    acct = cost.account(records)
    first, second = acct.attempts
    assert acct.trained_steps == 20 and acct.tokens == 20_000
    assert first.seconds["productive"] == 10.0 and first.seconds["restarts"] == 0.0
    assert first.seconds["other"] == pytest.approx(first.wall_s - 20.0 - 10.0 - 3.0)
    assert second.seconds["productive"] == 5.0


def test_a_rollback_takes_the_steps_after_its_checkpoint_back() -> None:
    records = [
        start(0.0),
        steps(20.0, 1, 8, 8.0, started=10.0),
        {"event": "rollback", "t": 21.0, "from_step": 8, "to_step": 5},
        steps(30.0, 6, 8, 3.0, started=21.0),
        {"event": "end", "t": 30.0, "step": 8, "reason": "done"},
    ]
    (attempt,) = cost.account(records).attempts
    assert attempt.seconds["rollbacks"] == 3.0 and attempt.seconds["productive"] == 8.0


def test_the_report_prices_node_hours_and_names_every_cause(tmp_path: Path, capsys) -> None:
    ledger = tmp_path / cost.LEDGER
    ledger.write_text(
        "".join(json.dumps(r) + "\n" for r in two_attempts()) + '{"event": "ste'
    )  # torn last line
    assert dskit_main(["cost", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["price_per_hour"] == 55.04  # p5.48xlarge from the shipped table
    assert out["cost"] == pytest.approx(2 * 72.0 / 3600 * 55.04)
    assert sum(out["by_cause_node_seconds"].values()) == pytest.approx(out["paid_node_seconds"])
    assert dskit_main(["cost", str(ledger), "--price_per_hour", "10"]) == 0
    text = capsys.readouterr().out
    assert "goodput: 27.8%" in text and "$0.40 at $10/h (--price_per_hour)" in text
    assert "per billion tokens" in text
    for cause in ("productive", *cost.CAUSES):
        assert f"  {cause} " in text


def test_without_a_price_it_says_how_to_give_one(tmp_path: Path, capsys) -> None:
    records = two_attempts()
    for r in records:
        if r["event"] == "start":
            r["instance_type"] = "p5e.48xlarge"  # capacity blocks only: no on-demand price
    (tmp_path / cost.LEDGER).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert dskit_main(["cost", str(tmp_path)]) == 0
    assert "no price: p5e.48xlarge has no on-demand price" in capsys.readouterr().out


def test_a_missing_ledger_or_bad_prices_file_is_one_line(tmp_path: Path, capsys) -> None:
    assert dskit_main(["cost", str(tmp_path)]) == 2
    assert f"no ledger at {tmp_path / cost.LEDGER}" in capsys.readouterr().err
    (tmp_path / cost.LEDGER).write_text(json.dumps(start(0.0)) + "\n")
    (tmp_path / "p.json").write_text("[1]")
    assert dskit_main(["cost", str(tmp_path), "--prices", str(tmp_path / "p.json")]) == 2
    assert "expected an object" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="line 1 is not JSON"):
        (tmp_path / "bad.jsonl").write_text("nope\n{}\n")
        cost.read(tmp_path / "bad.jsonl")


def test_the_shipped_price_table_is_dated_sourced_and_covers_the_named_families() -> None:
    table = json.loads(cost.PRICES.read_text())
    assert table["dated"] and table["source"].startswith("AWS EC2 on-demand list prices")
    for family in ("p4d.", "p5.", "p5e.", "p5en.", "g5.", "g6e.", "trn1."):
        assert any(name.startswith(family) for name in table["on_demand"])
    assert all(v is None or v > 0 for v in table["on_demand"].values())
    assert all(name in table["notes"] for name, v in table["on_demand"].items() if v is None)

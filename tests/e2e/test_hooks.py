"""The loop's observer seam through the real Trainer (one gloo rank, ZeRO-2 with CPU Adam): the order in which a
run meets the points, an observer's stop honoured like a preemption (saved, the end record and stop-reason file say
why), and a failing observer ending the run with its own error. The seam itself: tests/unit/loop/test_hooks.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_utils import launch_env
from model_utils.config.arguments import parse_args
from model_utils.loop import trainer as training
from model_utils.loop.hooks import Observer, StepReport, Stop
from model_utils.loop.observers.reporting import Reporting
from model_utils.observe import step_line
from model_utils.resolve import resolver
from support.observers import Recorder, find

pytestmark = pytest.mark.e2e


def make_trainer(tmp_path: Path, dist) -> training.Trainer:
    cfg = parse_args(
        [
            "--max_steps", "4", "--warmup_steps", "1", "--seq_length", "32", "--logging_freq", "2",
            "--checkpoint_freq", "2", "--validation_freq", "2", "--validation_batches", "1",
            "--metrics_file", str(tmp_path / "metrics.jsonl"), "--report_dir", str(tmp_path / "logs"),
            "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ckpt"),
        ]
    )  # fmt: skip
    return training.Trainer(resolver.prepare(cfg, world_size=dist.world_size), dist)


def test_a_run_meets_the_points_in_order_and_an_observers_stop_is_honoured(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(launch_env.STOP_REASON_FILE, str(tmp_path / "stop_reason"))
    calls: list[tuple[Any, ...]] = []
    watchdog = Recorder("w", calls, stop_at=3)
    trainer = make_trainer(tmp_path, single_rank)
    assert [type(o).__name__ for o in trainer.hooks.observers] == [
        "Watchdog",
        "Guard",
        "Ledger",
        "Validator",
        "Walltime",
        "Checkpointer",
        "Reporting",
    ]
    trainer.hooks.attach([watchdog, *trainer.hooks.observers])
    try:
        state = trainer.fit()
    finally:
        trainer.close()
    steps = [[("before_step", s), ("after_step", s, "trained")] for s in (1, 2, 3)]
    saved = [[("tags_in_use", f"tiny_qwen3-{s}steps"), ("after_checkpoint_saved", s)] for s in (2, 3)]
    assert [call[1:] for call in calls] == [
        ("on_start", 0),
        *steps[0],
        *steps[1],
        ("after_validation", 2),
        *saved[0],
        *steps[2],  # the watchdog asks to stop after step 3: saved there, though no checkpoint is due
        *saved[1],
        ("on_end", 3, "watchdog"),
        ("on_close",),
    ]
    assert state.step == 3 and (tmp_path / "ckpt" / "tiny_qwen3-3steps").is_dir()
    assert (tmp_path / "stop_reason").read_text() == "watchdog\n"  # not requeued: not walltime
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1] == {**records[-1], "event": "end", "step": 3, "reason": "watchdog"}
    events = [(r["event"], r["step"]) for r in records if "event" in r]
    assert events == [("start", 0), ("checkpoint", 2), ("checkpoint", 3), ("end", 3)]
    out = capsys.readouterr().out
    assert (
        step_line.stopped_line(3, "watchdog", f"step 3 took {watchdog.reports[2].seconds:.1f} s (a test)")
        in out
    )
    assert "Done: " not in out
    # What a watchdog or a tracker gets each step.
    for r in watchdog.reports:
        assert r.state is trainer.state and r.lr > 0 and r.grad_norm is not None and r.grad_norm > 0
        assert 0 <= r.data_wait_s < r.seconds
    # The reporter logged step 2 from the same numbers: the mean loss of steps 1 and 2 (one rank).
    (logged,) = [r for r in records if "loss" in r]
    assert logged["step"] == 2 and logged["lr"] == pytest.approx(watchdog.reports[1].lr)
    assert logged["loss"] == pytest.approx((watchdog.reports[0].loss + watchdog.reports[1].loss) / 2)


def test_a_failing_observer_ends_the_run_with_its_error_and_everything_is_closed(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Failing(Observer):
        def after_step(self, report: StepReport) -> Stop | None:
            raise RuntimeError(f"observer failed at step {report.step}")

    calls: list[tuple[Any, ...]] = []
    trainer = make_trainer(tmp_path, single_rank)
    closed = []
    monkeypatch.setattr(find(trainer, Reporting).reporter.tracker, "close", lambda: closed.append("tracker"))
    trainer.hooks.attach([Failing(), Recorder("r", calls), *trainer.hooks.observers])
    with pytest.raises(RuntimeError, match="observer failed at step 1"):
        try:
            trainer.fit()
        finally:
            trainer.close()
    assert [call[1] for call in calls] == ["on_start", "before_step", "on_close"]
    assert closed == ["tracker"] and "engine" not in vars(trainer)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in records] == ["start"]  # no end record: the run did not end, it failed

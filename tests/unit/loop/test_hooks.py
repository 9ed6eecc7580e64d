"""The loop's observer seam (model_utils/loop/hooks.py): each point calls every observer in order, a Stop comes
back typed, a failing observer's error is not swallowed; and through the real Trainer (one gloo rank, ZeRO-2 with
CPU Adam): the order in which a run meets the points, an observer's stop honoured like a preemption (saved, the
end record and stop-reason file say why), and a failing observer ending the run with its own error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from model_utils.config.arguments import parse_args
from model_utils.data.sampler import DataPosition
from model_utils.launch import launch_env
from model_utils.loop import hooks
from model_utils.loop import trainer as training
from model_utils.loop.hooks import GuardEvent, Hooks, Observer, SavedCheckpoint, StepReport, Stop
from model_utils.loop.observers import guard_records
from model_utils.loop.spike_guard import Spike
from model_utils.loop.state import TrainState
from model_utils.observe import step_line
from model_utils.resolve import resolver


class Recorder(Observer):
    """Writes down every point it is called at, with what identifies the call."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]], stop_at: int | None = None) -> None:
        self.name, self.calls, self.stop_at = name, calls, stop_at
        self.reports: list[StepReport] = []

    def on_start(self, state: TrainState) -> None:
        self.calls.append((self.name, "on_start", state.step))

    def before_step(self, step: int) -> None:
        self.calls.append((self.name, "before_step", step))

    def after_step(self, report: StepReport) -> Stop | None:
        self.calls.append((self.name, "after_step", report.step, report.outcome))
        self.reports.append(report)
        if report.step == self.stop_at:
            return Stop("watchdog", f"step {report.step} took {report.seconds:.1f} s (a test)")
        return None

    def after_validation(self, step: int, val_loss: float) -> Stop | None:
        self.calls.append((self.name, "after_validation", step))
        return None

    def tags_in_use(self, tag: str) -> set[str]:
        self.calls.append((self.name, "tags_in_use", tag))
        return {f"{self.name}-keeps"}

    def after_checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        self.calls.append((self.name, "after_checkpoint_saved", saved.step))

    def on_guard_event(self, event: GuardEvent) -> None:
        self.calls.append((self.name, "on_guard_event", event.kind))

    def on_end(self, state: TrainState, reason: str) -> None:
        self.calls.append((self.name, "on_end", state.step, reason))

    def on_close(self) -> None:
        self.calls.append((self.name, "on_close"))


def report(step: int, outcome: str = hooks.TRAINED) -> StepReport:
    return StepReport(step, outcome, 1.0, 1e-3, 0.5, 0.01, 0.2, None, TrainState(step=step))


# --- the dispatcher ---------------------------------------------------------------------------------------------


def test_each_point_calls_every_observer_in_order() -> None:
    calls: list[tuple[Any, ...]] = []
    seam = Hooks([Recorder("a", calls), Recorder("b", calls)])
    state = TrainState(step=4)
    seam.on_start(state)
    seam.before_step(5)
    seam.on_guard_event(GuardEvent("spike_skip", 5, {}, spike=Spike("loss", float("inf"), None)))
    seam.after_step(report(5))
    seam.after_validation(5, 2.5)
    assert seam.tags_in_use("t-5steps") == {"a-keeps", "b-keeps"}
    seam.after_checkpoint_saved(SavedCheckpoint(5, "t-5steps", None, 0.1))
    seam.on_end(state, "done")
    seam.on_close()
    points = [
        ("on_start", 4),
        ("before_step", 5),
        ("on_guard_event", "spike_skip"),
        ("after_step", 5, "trained"),
        ("after_validation", 5),
        ("tags_in_use", "t-5steps"),
        ("after_checkpoint_saved", 5),
        ("on_end", 4, "done"),
        ("on_close",),
    ]
    assert calls == [(name, *point) for point in points for name in ("a", "b")]
    assert seam.stop is None


def test_the_first_stop_asked_for_is_kept() -> None:
    class Early(Observer):
        def after_validation(self, step: int, val_loss: float) -> Stop | None:
            return Stop("early_stop", f"validation loss {val_loss} stopped improving")

    calls: list[tuple[Any, ...]] = []
    seam = Hooks([Recorder("a", calls, stop_at=3), Early()])
    seam.after_step(report(2))
    assert seam.stop is None
    seam.after_step(report(3))
    assert seam.stop == Stop("watchdog", "step 3 took 0.2 s (a test)")
    seam.after_validation(3, 2.5)
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
    for outcome in (hooks.DISCARDED, hooks.DROPPED):
        assert not report(1, outcome).applied and not report(1, outcome).trained


def test_guard_records_are_the_metrics_files_guard_events() -> None:
    spike = Spike("grad norm", 41.5, 3.2)
    skip = GuardEvent("spike_grad_norm", 7, {"spike_guard/rollbacks": 0}, spike=spike)
    assert guard_records.record(skip) == {
        "event": "spike_grad_norm",
        "step": 7,
        "signal": "grad norm",
        "value": 41.5,
        "threshold": 3.2,
    }
    back = hooks.Rollback(9, "t-5steps", "2 loss spikes in a row", DataPosition(0, 10), DataPosition(0, 18))
    record = guard_records.record(GuardEvent("rollback", 5, {}, rollback=back))
    assert record == {
        "event": "rollback",
        "step": 5,
        "from_step": 9,
        "tag": "t-5steps",
        "reason": "2 loss spikes in a row",
        "skip_from": DataPosition(0, 10).to_dict(),
        "skip_to": DataPosition(0, 18).to_dict(),
    }
    assert list(record) == ["event", "step", "from_step", "tag", "reason", "skip_from", "skip_to"]


# --- through the real Trainer -----------------------------------------------------------------------------------


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
    assert [type(o).__name__ for o in trainer.hooks.observers] == ["GuardRecords", "Reporting"]
    trainer.hooks = Hooks([watchdog, *trainer.hooks.observers])
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
    ends = [end for line in capsys.readouterr().out.splitlines() if (end := step_line.parse_end(line))]
    assert ends == [
        step_line.End("watchdog", 3, detail=f"step 3 took {watchdog.reports[2].seconds:.1f} s (a test)")
    ]
    # What a watchdog or a tracker gets each step.
    for r in watchdog.reports:
        assert r.state is trainer.state and r.lr > 0 and r.grad_norm is not None and r.grad_norm > 0
        assert 0 <= r.data_wait_s < r.seconds and r.time_left is None  # no SLURM time limit here
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
    monkeypatch.setattr(trainer.reporter.tracker, "close", lambda: closed.append("tracker"))
    trainer.hooks = Hooks([Failing(), Recorder("r", calls), *trainer.hooks.observers])
    with pytest.raises(RuntimeError, match="observer failed at step 1"):
        try:
            trainer.fit()
        finally:
            trainer.close()
    assert [call[1] for call in calls] == ["on_start", "before_step", "on_close"]
    assert closed == ["tracker"] and "engine" not in vars(trainer)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("event") for r in records] == ["start"]  # no end record: the run did not end, it failed

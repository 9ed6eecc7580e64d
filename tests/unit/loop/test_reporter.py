"""The reporter's pieces that need no run: where the metrics file goes (none, beside the SLURM log, or as given);
a mixture's shares and per-source losses in its records and lines.
The log line <-> record round trip: test_step_line.py; the reporter in a real run: tests/e2e/test_trainer.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from model_utils import launch_env
from model_utils.config.arguments import parse_args
from model_utils.loop.hooks import DISCARDED, TRAINED, StepReport
from model_utils.loop.reporter import Reporter, metrics_path
from model_utils.loop.state import TrainState
from model_utils.observe import metrics, trackers


def test_metrics_file_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch_env.LOG_FILE, raising=False)
    assert metrics_path("none", "logs", "run") is None
    assert metrics_path("auto", "somewhere", "run-1") == Path("somewhere/run-1.metrics.jsonl")
    monkeypatch.setenv(launch_env.LOG_FILE, "/x/logs/train_7.out")
    assert metrics_path("auto", "logs", "run") == Path("/x/logs/train_7.metrics.jsonl")
    assert metrics_path("m.jsonl", "logs", "run") == Path("m.jsonl")


def stepped(n: int, outcome: str = TRAINED, seconds: float = 2.0, loss: float = 0.5) -> StepReport:
    return StepReport(n, outcome, loss, 1e-3, None, 0.25, seconds, TrainState(step=n), trained_tokens=63)


def test_a_discarded_steps_time_counts_in_the_step_time_and_its_loss_does_not(
    tmp_path: Path, gloo_rank
) -> None:
    reporter = Reporter(parse_args(["--metrics_file", "none"]), gloo_rank, 10, 64, 1e6, None)
    reporter.tracker = RecordingTracker()  # type: ignore[assignment]
    reporter.step_clocked(stepped(1, seconds=1.0, loss=2.0))
    reporter.step_clocked(stepped(2, DISCARDED, seconds=1.0, loss=float("nan")))
    reporter.step_clocked(stepped(2, seconds=2.0, loss=4.0))
    assert reporter.step_time() == 2.0  # 4 s for 2 steps that stand
    record = reporter.log_step(stepped(2), None)
    assert (record["loss"], record["step_time_s"], record["tokens_per_s"]) == (3.0, 2.0, 32.0)
    assert record["data_wait_frac"] == pytest.approx(0.75 / 4.0)
    assert reporter.step_time() == 2.0 and reporter.clock.steps == 0  # the last interval's, until the next


class RecordingTracker:
    def __init__(self) -> None:
        self.points: list[tuple[int, dict]] = []

    def log_metrics(self, step: int, values: dict) -> None:
        self.points.append((step, values))


def test_a_mixtures_shares_and_source_scores_reach_the_record_the_line_and_the_tracker(
    tmp_path: Path, gloo_rank, capsys
) -> None:
    cfg = parse_args(["--metrics_file", str(tmp_path / "m.jsonl")])
    reporter = Reporter(cfg, gloo_rank, 10, 64, 1e6, None)
    reporter.metrics = metrics.MetricsFile(tmp_path / "m.jsonl")
    reporter.tracker = tracker = RecordingTracker()  # type: ignore[assignment]
    reporter.step_clocked(stepped(1))
    record = reporter.log_step(stepped(1), None, {"web": 0.75, "code": 0.25})
    assert (record["share/web"], record["share/code"]) == (0.75, 0.25)
    web, code = (
        metrics.Score(200.0, 100, 250),
        metrics.Score(400.0, 100, 0),
    )  # code: no text bytes (all special)
    reporter.log_validation(
        1,
        metrics.Validation(
            metrics.Score.combined([web, code]), 4, 8, 1.25, sources=(("web", web), ("code", code))
        ),
    )
    written = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert written[0]["share/code"] == 0.25
    val = written[1]
    assert (val["val_loss"], val["val_tokens"], val["val_s"]) == (3.0, 200, 1.25)
    assert val["val_bpb"] == pytest.approx(600.0 / (math.log(2) * 250))
    assert (val["val_loss/web"], val["val_tokens/web"], val["val_loss/code"]) == (2.0, 100, 4.0)
    assert val["val_ppl/web"] == pytest.approx(math.exp(2.0)) and val["val_ppl/code"] == pytest.approx(
        math.exp(4.0)
    )
    assert (
        val["val_bpb/web"] == pytest.approx(200.0 / (math.log(2) * 250)) and val["val_bpb/code"] is None
    )  # NaN
    # The tracker gets the validation record's numbers (a NaN is left out there), under val/ and per source.
    step, tracked = tracker.points[-1]
    assert step == 1 and set(tracked) == set(val) - {"step", "time"} and math.isnan(tracked["val_bpb/code"])
    assert all(tracked[k] == v for k, v in val.items() if k not in ("step", "time", "val_bpb/code"))
    names = dict(trackers.scalar_items(tracked))
    assert {
        "val/loss",
        "val/ppl",
        "val/bpb",
        "val/tokens",
        "val/seconds",
        "val_bpb/web",
        "val_tokens/code",
    } <= set(names)
    assert "val_bpb/code" not in names
    out = capsys.readouterr().out
    assert "| shares web 75.0% code 25.0% |" in out
    assert (
        "| 4 of 8 blocks (200 target tokens) | took 1.2 s | per source web 2.0000 ppl 7.39 bits/byte 1.1542"
        in out
    )
    reporter.step_clocked(stepped(2))
    plain = reporter.log_step(stepped(2), None)
    assert not any(key.startswith("share/") for key in plain)  # one dataset: no shares


class Tracker(trackers.NoTracker):
    def __init__(self) -> None:
        self.logged: list[tuple[str, int, object]] = []

    def log_samples(self, step: int, samples: list[tuple[str, str]]) -> None:
        self.logged.append(("samples", step, samples))

    def log_metrics(self, step: int, metrics: dict) -> None:
        self.logged.append(("metrics", step, metrics))


def test_samples_reach_the_log_the_metrics_file_and_the_tracker(tmp_path: Path, gloo_rank, capsys) -> None:
    reporter = Reporter(parse_args([]), gloo_rank, 10, 64, 1e6, None)
    reporter.metrics = metrics.MetricsFile(tmp_path / "m.jsonl")
    reporter.tracker = tracker = Tracker()
    reporter.log_samples(5, [("Once", " upon a time")], 0.5)
    [record] = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert {k: v for k, v in record.items() if k != "time"} == {
        "event": "samples",
        "step": 5,
        "sample_s": 0.5,
        "samples": [{"prompt": "Once", "text": " upon a time"}],
    }
    assert tracker.logged == [("samples", 5, [("Once", " upon a time")]), ("metrics", 5, {"sample_s": 0.5})]
    assert "  [1] 'Once' -> 'upon a time'" in capsys.readouterr().out


def test_the_run_summary_follows_the_run_and_a_requeued_job_adds_to_it(
    tmp_path: Path, gloo_rank, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What dskit.api reads (observe/run_summary.py): the ids and files at the start, the last logged step and
    loss, the last validation, the newest checkpoint and the end; a later job keeps what it does not say again."""
    from model_utils.observe import run_summary

    summary = tmp_path / "summary.json"
    monkeypatch.setenv(launch_env.RUN_SUMMARY, str(summary))
    monkeypatch.chdir(tmp_path)
    cfg = parse_args(["--metrics_file", "m.jsonl", "--checkpoint_dir", "ck"])
    first = Reporter(cfg, gloo_rank, 4, 64, 1e6, None)
    first.open("tiny_qwen3-1", {}, None)
    first.step_clocked(stepped(2, loss=3.0))
    first.log_step(stepped(2), None)
    first.log_validation(2, metrics.Validation(metrics.Score(200.0, 100, 250), 4, 8, 1.0))
    first.event({"event": "checkpoint", "step": 2, "tag": "t-2steps", "save_s": 0.1})
    first.event({"event": "end", "step": 2, "reason": "preempted"})
    first.close()
    assert run_summary.read(summary) == {
        "run_id": "tiny_qwen3-1", "metrics_file": str(tmp_path / "m.jsonl"), "mlflow_run_id": None,
        "max_steps": 4, "step": 2, "train_loss": 3.0, "validation_step": 2, "validation_loss": 2.0,
        "checkpoint": str(tmp_path / "ck" / "t-2steps"), "end": "preempted", "end_step": 2,
    }  # fmt: skip
    again = Reporter(cfg, gloo_rank, 4, 64, 1e6, None)
    again.open("tiny_qwen3-1", {"mlflow": {"run_id": "abc"}}, 2)
    again.step_clocked(stepped(4, loss=1.0))
    again.log_step(stepped(4), None)
    again.event({"event": "end", "step": 4, "reason": "done"})
    again.close()
    read = run_summary.read(summary)
    assert (read["mlflow_run_id"], read["step"], read["train_loss"], read["end"], read["end_step"]) == (
        "abc", 4, 1.0, "done", 4,
    )  # fmt: skip
    assert (read["validation_loss"], read["checkpoint"]) == (2.0, str(tmp_path / "ck" / "t-2steps"))  # kept
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".summary")] == []  # no temp file left


def test_without_the_variable_no_summary_is_written(tmp_path: Path, gloo_rank, monkeypatch) -> None:
    monkeypatch.delenv(launch_env.RUN_SUMMARY, raising=False)
    monkeypatch.chdir(tmp_path)
    reporter = Reporter(parse_args(["--metrics_file", "none"]), gloo_rank, 4, 64, 1e6, None)
    reporter.event({"event": "end", "step": 0, "reason": "done"})
    assert list(tmp_path.iterdir()) == []

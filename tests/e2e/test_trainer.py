"""The real Trainer in this process (one gloo rank, DeepSpeed ZeRO-2 with CPU Adam): metrics records, the
walltime reaction, the progress bar and a resumed run continuing the same metrics file and TensorBoard run.

The walltime *decisions* are scripted here (their arithmetic is tested in test_walltime.py); what is tested is
what the loop does with them: an early save that keeps training, and a save-and-stop that a requeue resumes.
"""

from __future__ import annotations

import json
import os
import pty
from pathlib import Path

import pytest

from model_utils import preflight
from model_utils import trainer as training
from model_utils.arguments import parse_args
from model_utils.walltime import Decision, WalltimePlanner


class ScriptedPlanner(WalltimePlanner):
    def __init__(self, trainer: training.Trainer, script: dict[int, Decision]) -> None:
        super().__init__(end_time_source=lambda: None)
        self.trainer, self.script = trainer, script

    def decide(self, step: int, step_time: float, next_checkpoint_step: int) -> Decision:
        assert step_time > 0 and step < next_checkpoint_step <= self.trainer.cfg.loop.max_steps
        return self.script.get(step, Decision())


def make_trainer(tmp_path: Path, dist, max_steps: int, *extra: str) -> training.Trainer:
    cfg = parse_args(
        [
            "--max_steps", str(max_steps), "--logging_freq", "2", "--checkpoint_freq", "100",
            "--validation_freq", "4", "--validation_batches", "2", "--seq_length", "64",
            "--data_cache_dir", str(tmp_path / "cache"), "--checkpoint_dir", str(tmp_path / "ckpt"),
            "--report_dir", str(tmp_path / "logs"), "--report_to", "tensorboard", *extra,
        ]
    )  # fmt: skip
    return training.Trainer(cfg, preflight.prepare(cfg), dist)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_walltime_stop_then_resume_continues_the_run(
    tmp_path: Path, single_rank, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "logs" / "job_123.out"
    monkeypatch.setenv(training.LOG_FILE_ENV, str(log))
    monkeypatch.setenv(training.STOP_REASON_ENV, str(tmp_path / "stop_reason"))
    primary, replica = pty.openpty()
    monkeypatch.setenv("DSKIT_TTY", os.ttyname(replica))

    trainer = make_trainer(tmp_path, single_rank, 8)
    trainer.walltime = ScriptedPlanner(trainer, {3: Decision(save_now=True), 5: Decision(stop_now=True)})
    state = trainer.fit()
    out = capsys.readouterr().out

    assert state.step == 5
    assert (tmp_path / "stop_reason").read_text() == "walltime\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("tiny_qwen3-*")) == [
        "tiny_qwen3-3steps",
        "tiny_qwen3-5steps",
    ]
    assert "Saving early at step 3" in out and "Stopped at step 5 before the job's time limit" in out
    bar = os.read(primary, 1 << 16).decode()
    assert "] 1/8 (12%) loss" in bar and "ETA" in bar  # the bar went to the terminal...
    assert "[###" not in out and "] 1/8" not in out  # ...and never into the log

    metrics_file = log.with_suffix(".metrics.jsonl")  # next to the launcher's log
    first = records(metrics_file)
    events = [(r["event"], r["step"]) for r in first if "event" in r]
    assert events == [("start", 0), ("checkpoint", 3), ("checkpoint", 5), ("end", 5)]
    assert first[-1]["reason"] == "walltime"
    train = [r for r in first if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_device"])  # one rank
        assert r["tflops_per_device"] == pytest.approx(
            r["tokens_per_s_per_device"] * trainer.flops_per_token / 1e12
        )
        assert r["mfu"] is None and r["device_mem_alloc_gib"] is None  # CPU: no known peak, no device memory
        assert 0 < r["data_wait_frac"] < 1 and r["host_rss_gib"] > 0.1 and r["step_time_s"] > 0
        assert r["skipped_steps"] == 0 and r["lr"] > 0 and r["grad_norm"] > 0
    assert [r["step"] for r in first if "val_loss" in r] == [4]
    assert "Metrics overhead:" in out and trainer.metrics_overhead_s > 0

    # The requeued job: same checkpoint dir, same log; it resumes at step 5 and continues run and file.
    again = make_trainer(tmp_path, single_rank, 8)
    assert again.state.step == 5 and again.state.run_id == state.run_id
    again.fit()
    log.write_text(out + capsys.readouterr().out)  # what the launcher's tee would have written
    second = records(metrics_file)[len(first) :]
    start = second[0]
    assert start["event"] == "start" and start["resumed_from"] == "tiny_qwen3-5steps"
    assert start["run_id"] == state.run_id
    assert [r["step"] for r in second if "loss" in r] == [6, 8]
    assert second[-1] == {**second[-1], "event": "end", "reason": "done", "step": 8}

    # `dskit plot` of this real run: one PNG, the resume at step 5 marked.
    from PIL import Image

    from dskit import cli, plot

    assert cli.main(["plot", str(log)]) == 0  # the log: its metrics file is read
    with Image.open(log.with_suffix(".png")) as image:
        assert image.format == "PNG" and image.size[0] >= 800
    plotted = plot.load_run(log)
    assert plotted.resumes == (5,) and plotted.run_id == state.run_id
    assert plotted.series["loss"].steps == (2, 4, 6, 8)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = list((tmp_path / "logs" / "tensorboard").iterdir())
    assert [p.name for p in runs] == [state.run_id]  # one run, continued
    events = EventAccumulator(str(runs[0])).Reload()
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(losses) == [2, 4, 6, 8]
    assert losses[2] == pytest.approx(train[0]["loss"])


def test_metrics_file_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(training.LOG_FILE_ENV, raising=False)
    assert training.metrics_path("none", "logs", "run") is None
    assert training.metrics_path("auto", "somewhere", "run-1") == Path("somewhere/run-1.metrics.jsonl")
    monkeypatch.setenv(training.LOG_FILE_ENV, "/x/logs/train_7.out")
    assert training.metrics_path("auto", "logs", "run") == Path("/x/logs/train_7.metrics.jsonl")
    assert training.metrics_path("m.jsonl", "logs", "run") == Path("m.jsonl")

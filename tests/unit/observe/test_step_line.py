"""Every log line that is read back: format -> parse gives the values back, after rank 0's timestamp too, and
the texts that launchers, SLURM tests and users grep for stay as they were. (The step and validation lines'
round trips are in test_reporter.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.observe import step_line
from model_utils.observe.step_line import End, RunFiles

STAMP = "2026-11-23 12:00:00 | "


@pytest.mark.parametrize("prefix", ["", STAMP])
def test_end_lines_round_trip(prefix: str) -> None:
    done = step_line.done_line(12, 20, 4096)
    assert done == "Done: step 12/20, 4096 tokens seen"
    assert step_line.parse_end(prefix + done) == End("done", 12, max_steps=20, tokens_seen=4096)
    preempted = step_line.preempted_line(7, "SIGUSR1")
    assert preempted == "Preempted: stop requested by SIGUSR1; saved at step 7"
    assert step_line.parse_end(prefix + preempted) == End("preempted", 7, detail="SIGUSR1")
    walltime = step_line.walltime_line(5)
    assert walltime == "Stopped at step 5 before the job's time limit; saved (a requeued job resumes here)"
    assert step_line.parse_end(prefix + walltime) == End("walltime", 5)
    why = "step 9 took 41.0 s: 10x the median (--watchdog 10)"
    stopped = step_line.stopped_line(9, "watchdog", why)
    assert step_line.parse_end(prefix + stopped) == End("watchdog", 9, detail=why)


def test_lines_that_are_no_end_line() -> None:
    for line in (
        STAMP + step_line.step_line({"step": 5, "loss": 1.0, "eta_s": 3}, 5),
        STAMP + "Training tiny_qwen3 for 8 steps: 1 ranks x micro batch 1",
        STAMP + "Saving early at step 3: the next checkpoint would land too close to the time limit",
        STAMP + "Stopped at step 3 somewhere else",
    ):
        assert step_line.parse_end(line) is None, line


@pytest.mark.parametrize("tag_dir", ["checkpoints/tiny_qwen3-5steps", "/mnt/my runs/ckpt/tiny_qwen3-5steps"])
def test_saved_line_round_trips_any_path(tag_dir: str) -> None:
    line = step_line.saved_line(Path(tag_dir), "0.003 GB in 0.03 s, 0.09 GB/s")
    assert line == f"Saved checkpoint {tag_dir} (0.003 GB in 0.03 s, 0.09 GB/s)"
    assert step_line.parse_saved(STAMP + line) == tag_dir
    assert step_line.parse_saved(STAMP + f"Loaded checkpoint {tag_dir} (0.003 GB in 0.03 s)") is None


def test_run_line_round_trips_with_and_without_a_tracker_or_a_metrics_file() -> None:
    path = Path("logs/job_7.metrics.jsonl")
    bare = step_line.run_line("tiny_qwen3-1", path, "none", "logs")
    assert bare == "Run tiny_qwen3-1: metrics to logs/job_7.metrics.jsonl"
    assert step_line.parse_run(STAMP + bare) == RunFiles("tiny_qwen3-1", str(path), "none")
    tracked = step_line.run_line("tiny_qwen3-1", path, "mlflow", "logs")
    assert tracked == "Run tiny_qwen3-1: metrics to logs/job_7.metrics.jsonl, mlflow under logs"
    assert step_line.parse_run(STAMP + tracked) == RunFiles("tiny_qwen3-1", str(path), "mlflow")
    nowhere = step_line.run_line("r", None, "tensorboard", "/x/logs")
    assert nowhere == "Run r: metrics to nowhere (--metrics_file none), tensorboard under /x/logs"
    assert step_line.parse_run(nowhere) == RunFiles("r", None, "tensorboard")
    assert step_line.parse_run(STAMP + "Training run r for 8 steps") is None


def test_mlflow_line_round_trips() -> None:
    run_id, parent = "0123456789abcdef0123456789abcdef", "f" * 32
    line = step_line.mlflow_line(run_id, "dskit", "sqlite:////x/logs/mlflow.db", None)
    assert line == f"MLflow run {run_id} in experiment 'dskit' at sqlite:////x/logs/mlflow.db"
    assert step_line.parse_mlflow(STAMP + line) == run_id
    child = step_line.mlflow_line(run_id, "sweep", "http://mlflow:5000", parent)
    assert child.endswith(f", child of {parent}") and step_line.parse_mlflow(STAMP + child) == run_id
    warning = STAMP + f"WARNING: MLflow: run {run_id} was deleted: starting a new run"
    assert step_line.parse_mlflow(warning) is None


def test_error_line_round_trips() -> None:
    message = "unknown flag --max_step: did you mean --max_steps?"
    assert step_line.error_line(message) == f"error: {message}"
    assert step_line.parse_error(step_line.error_line(message)) == message
    assert step_line.parse_error(f"node1 | error: {message}\n") == message
    assert step_line.parse_error(STAMP + "WARNING: retry after error: timed out") is None

"""`--profile_steps A:B`: a real torch profiler trace of steps A to B written next to the metrics file, what a
resumed job profiles, and a run stopped inside the window writing nothing. The flag in a real run (read back from
MLflow): tests/e2e/test_trainer.py."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from model_utils.observe import profiling

CPU = torch.device("cpu")


def run_steps(profiler: profiling.StepProfiler, steps: range) -> list[Path | None]:
    written = []
    for step in steps:
        profiler.step_starting(step)
        torch.ones(64, 64) @ torch.ones(64, 64)  # the step's work
        written.append(profiler.step_done(step))
    return written


def test_trace_path_is_beside_the_metrics_file() -> None:
    assert profiling.trace_path(Path("logs/job_123.metrics.jsonl"), 3, 4) == Path(
        "logs/job_123.profile-steps3-4.pt.trace.json.gz"
    )


def test_the_window_is_one_trace_with_a_range_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = profiling.StepProfiler((2, 3), tmp_path / "run.metrics.jsonl", CPU, resumed_at=0)
    written = run_steps(profiler, range(1, 5))
    path = tmp_path / "run.profile-steps2-3.pt.trace.json.gz"
    assert written == [None, None, path, None]  # once, after step 3
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    ranges = {e["name"] for e in events if e.get("name", "").startswith("optimizer_step_")}
    assert ranges == {"optimizer_step_2", "optimizer_step_3"}
    assert f"Profiled steps 2-3: {path} (" in capsys.readouterr().out


def test_a_resumed_job_profiles_what_is_left_or_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rest = profiling.StepProfiler((2, 5), tmp_path / "run.metrics.jsonl", CPU, resumed_at=3)
    assert run_steps(rest, range(4, 6)) == [None, tmp_path / "run.profile-steps4-5.pt.trace.json.gz"]
    after = profiling.StepProfiler((2, 3), tmp_path / "late.metrics.jsonl", CPU, resumed_at=3)
    assert "--profile_steps 2:3: the run resumed after them, nothing to profile" in capsys.readouterr().out
    assert run_steps(after, range(4, 6)) == [None, None]
    assert not list(tmp_path.glob("late.*"))


def test_a_run_stopped_inside_the_window_writes_no_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiler = profiling.StepProfiler((1, 4), tmp_path / "run.metrics.jsonl", CPU, resumed_at=0)
    run_steps(profiler, range(1, 3))
    profiler.close()
    profiler.close()  # idempotent
    assert not list(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert out.count("WARNING: the run stopped before step 4: no profiler trace of steps 1-4") == 1

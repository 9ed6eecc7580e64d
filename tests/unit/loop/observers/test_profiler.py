"""`--profile_steps A:B` at the loop's points, with the real profiler (observe/profiling.py) and a stand-in
reporter: built only on the rank that writes the run's files and only when asked; each applied step is one range,
the trace is handed to the tracker; a run that stops inside the window
writes none."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import torch

from model_utils.loop import hooks
from model_utils.loop.hooks import StepReport
from model_utils.loop.observers.profiler import Profiler
from model_utils.loop.state import TrainState


class Reporter:
    def __init__(self, output_base: Path | None) -> None:
        self.output_base = output_base
        self.artifacts: list[tuple[Path, str]] = []

    def artifact(self, path: Path, folder: str) -> None:
        self.artifacts.append((path, folder))


def context(window: tuple[int, int] | None, reporter: Reporter, start_step: int = 0) -> Any:
    report = types.SimpleNamespace(profile_window=lambda: window)
    run = types.SimpleNamespace(config=types.SimpleNamespace(report=report))
    dist = types.SimpleNamespace(device=torch.device("cpu"))
    return types.SimpleNamespace(run=run, dist=dist, reporter=reporter, start_step=start_step)


def turn(profiler: Profiler, step: int, outcome: str = hooks.TRAINED) -> None:
    profiler.before_step(step)
    torch.ones(32, 32) @ torch.ones(32, 32)
    assert (
        profiler.after_step(StepReport(step, outcome, 2.0, 1e-3, None, 0.0, 0.1, TrainState(step=step)))
        is None
    )


def test_built_only_when_asked_and_where_the_run_writes_its_files(tmp_path: Path) -> None:
    assert Profiler.from_loop(context(None, Reporter(tmp_path / "run.metrics.jsonl"))) is None
    assert Profiler.from_loop(context((2, 3), Reporter(None))) is None  # a rank that writes no files
    assert Profiler.from_loop(context((2, 3), Reporter(tmp_path / "run.metrics.jsonl"))) is not None


def test_the_trace_goes_to_the_tracker(tmp_path: Path) -> None:
    reporter = Reporter(tmp_path / "run.metrics.jsonl")
    profiler = Profiler.from_loop(context((2, 3), reporter))
    assert profiler is not None
    turn(profiler, 1)
    turn(profiler, 2)
    turn(profiler, 3, hooks.DISCARDED)  # not applied: the window is not done
    assert reporter.artifacts == []
    turn(profiler, 3)
    trace = tmp_path / "run.profile-steps2-3.pt.trace.json.gz"
    assert reporter.artifacts == [(trace, "profiler")] and trace.is_file()
    profiler.on_close()
    assert reporter.artifacts == [(trace, "profiler")]


def test_a_run_closed_inside_the_window_writes_no_trace(tmp_path: Path) -> None:
    reporter = Reporter(tmp_path / "run.metrics.jsonl")
    profiler = Profiler.from_loop(context((1, 3), reporter))
    assert profiler is not None
    turn(profiler, 1)
    profiler.on_close()
    assert reporter.artifacts == [] and not list(tmp_path.iterdir())

"""The reporter's pieces that need no run: where the metrics file goes (none, beside the SLURM log, or as given).
The log line <-> record round trip: test_step_line.py; the reporter in a real run: tests/e2e/test_trainer.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils.launch import launch_env
from model_utils.observe.reporter import metrics_path


def test_metrics_file_location(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launch_env.LOG_FILE, raising=False)
    assert metrics_path("none", "logs", "run") is None
    assert metrics_path("auto", "somewhere", "run-1") == Path("somewhere/run-1.metrics.jsonl")
    monkeypatch.setenv(launch_env.LOG_FILE, "/x/logs/train_7.out")
    assert metrics_path("auto", "logs", "run") == Path("/x/logs/train_7.metrics.jsonl")
    assert metrics_path("m.jsonl", "logs", "run") == Path("m.jsonl")

"""observe/run_summary.py: the run's outcome as one JSON object where DSKIT_RUN_SUMMARY names it (the reporter's
part: tests/unit/loop/test_reporter.py; dskit.api's reading: tests/unit/dskit/test_api.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_utils import launch_env
from model_utils.observe import run_summary


def test_fields_are_merged_into_the_file_replaced_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "summary.json"
    monkeypatch.setenv(launch_env.RUN_SUMMARY, str(path))
    run_summary.update({"run_id": "r", "step": 2})
    run_summary.update({"step": 4, "exit_status": 0})
    assert run_summary.read(path) == {"run_id": "r", "step": 4, "exit_status": 0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp file left


def test_nothing_is_written_without_the_variable_and_an_unreadable_summary_reads_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(launch_env.RUN_SUMMARY, raising=False)
    monkeypatch.chdir(tmp_path)
    run_summary.update({"run_id": "r"})
    assert list(tmp_path.iterdir()) == []
    assert run_summary.read(tmp_path / "missing.json") == {}
    (tmp_path / "half.json").write_text('{"run_id": ')
    (tmp_path / "list.json").write_text("[1]")
    assert run_summary.read(tmp_path / "half.json") == run_summary.read(tmp_path / "list.json") == {}

"""Rank-0 logging: timestamped lines from rank 0 only, one `error:` line, and the progress bar drawn on the
launcher's terminal (DSKIT_TTY), never into the log. The bar in a real run: tests/e2e/test_trainer.py."""

from __future__ import annotations

import os
import re
import select
from pathlib import Path

import pytest

from model_utils import launch_env
from model_utils.observe import log


def drawn(controller: int) -> str:
    """What reached the terminal so far (the pty may hand it over in pieces)."""
    chunks = []
    while select.select([controller], [], [], 0.5)[0]:
        chunks.append(os.read(controller, 4096))
    return b"".join(chunks).decode()


@pytest.fixture(autouse=True)
def fresh_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bar opens its terminal once per process: each test gets its own."""
    monkeypatch.setattr(log, "_bar", log._ProgressBar())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv(launch_env.TTY, raising=False)


def test_lines_come_from_rank_0_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log.print0("Step 1/8 | Loss 7.6")
    log.warn0("the data is small")
    log.error_line("--lr must be positive")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \| Step 1/8 \| Loss 7.6", lines[0]), lines
    assert lines[1].endswith(" | WARNING: the data is small") and len(lines) == 2
    assert err == "error: --lr must be positive\n"
    monkeypatch.setenv("RANK", "1")
    log.print0("again")
    log.warn0("again")
    log.error_line("again")
    log.progress0(1, 8, "again")
    assert capsys.readouterr() == ("", "")
    assert not log.progress_shown()


def test_the_bar_goes_to_the_launchers_terminal_and_is_cleared_before_a_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    controller, terminal = os.openpty()
    try:
        monkeypatch.setenv(launch_env.TTY, os.ttyname(terminal))
        assert log.progress_shown()
        log.progress0(3, 12, "loss 7.1")
        log.print0("Saved checkpoint")
        assert drawn(controller) == "\r\033[K[#######.......................] 3/12 (25%) loss 7.1\r\033[K"
        assert "Saved checkpoint" in capsys.readouterr().out  # the line goes to stdout (the log), the bar not
        log.progress0(12, 12, "done")
        log.end_progress0()
        assert drawn(controller).endswith("12/12 (100%) done\r\033[K")
    finally:
        os.close(controller)
        os.close(terminal)


def test_no_terminal_no_bar(
    tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    not_a_tty = tmp_path / "log.txt"
    not_a_tty.write_text("")
    monkeypatch.setenv(launch_env.TTY, str(not_a_tty))
    assert not log.progress_shown()  # so the reporter composes no bar text either
    log.progress0(1, 2, "x")
    assert not_a_tty.read_text() == "" and capsys.readouterr().out == ""


def test_log_lines_error_lines_and_the_error_file_hold_no_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error_file = tmp_path / "error"
    monkeypatch.setenv(launch_env.ERROR_FILE, str(error_file))
    log.print0("MLflow run 1 at https://admin:pw@mlflow.example/ (--hf_token hf_abc)")
    log.error_line("cannot open https://bob:pw2@mlflow.example/?token=t0k: fix --tracking_uri")
    out, err = capsys.readouterr()
    assert out.endswith("| MLflow run 1 at https://mlflow.example/ (--hf_token ***)\n")
    assert err == "error: cannot open https://mlflow.example/?token=***: fix --tracking_uri\n"
    assert error_file.read_text() == err.removeprefix("error: ")  # the message


def test_every_ranks_first_error_line_goes_to_the_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    error_file = tmp_path / "error"
    monkeypatch.setenv(launch_env.ERROR_FILE, str(error_file))
    monkeypatch.setenv("RANK", "1")  # a host without rank 0: its ranks print nothing, but the file has it
    log.error_line("dataset path /data/x does not exist: fix the path")
    log.error_line("a later line")
    assert capsys.readouterr() == ("", "")
    assert error_file.read_text() == "dataset path /data/x does not exist: fix the path\n"

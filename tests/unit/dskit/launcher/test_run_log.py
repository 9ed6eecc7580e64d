"""launcher/run_log.py: train-singlenode.sh's log, made exclusively under the job name, renamed after the run. The
run's name from a stand-in interpreter (model_utils/observe/run_name.py has its own tests); the rest real files."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dskit.launcher import run_log
from model_utils.errors import ConfigError
from support.fake_commands import executable

REPO = Path(__file__).resolve().parents[4]
NOW = time.mktime((2026, 11, 26, 15, 2, 11, 0, 0, -1))


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # where the launcher runs: the kit's root, logs/ in it


def test_each_launch_makes_a_log_of_its_own() -> None:
    """A launch in the same second as another gets -2, -3, ...: never another launch's log."""
    made = [run_log.create("unit", NOW) for _ in range(3)]
    assert [str(p) for p in made] == [
        "logs/unit_20261126-150211.out", "logs/unit_20261126-150211-2.out", "logs/unit_20261126-150211-3.out"
    ]  # fmt: skip
    assert all(p.is_file() and p.stat().st_size == 0 for p in made)


@pytest.mark.parametrize("job_name", ["exp/1", "../up", "two words", "-dash", ""])
def test_a_job_name_that_cannot_name_its_log_is_refused(job_name: str) -> None:
    """A '/' in JOB_NAME made tee fail (logs/exp/1_<time>.out has no directory) and the run went on without its
    log: refused in one line before anything is made."""
    with pytest.raises(ConfigError) as e:
        run_log.create(job_name)
    assert str(e.value) == (
        f"JOB_NAME '{job_name}' cannot name the log file logs/<JOB_NAME>_<time>.out: use letters, digits, '.', '_' "
        f"or '-', starting with a letter or digit (e.g. JOB_NAME={re.sub(r'[^A-Za-z0-9._-]', '_', job_name)})"
    )
    assert not Path("logs").exists()


def test_a_logs_dir_that_cannot_be_made_is_said(tmp_path: Path) -> None:
    Path("logs").write_text("a file where the dir goes\n")
    with pytest.raises(
        ConfigError, match=f"^cannot create a log file in {tmp_path}/logs: make that dir writable$"
    ):
        run_log.create("unit")


def test_a_full_second_is_said(tmp_path: Path) -> None:
    for _ in range(run_log.MAX_SAME_SECOND):
        run_log.create("unit", NOW)
    with pytest.raises(ConfigError, match=r"^cannot create a log file in "):
        run_log.create("unit", NOW)


def test_the_log_is_renamed_after_the_run_keeping_its_time() -> None:
    log = run_log.create("qwen3_0_6b-DeepSpeed", NOW)
    log.write_text("START\n")
    named = run_log.rename(log.resolve(), "tiny-fsdp-lora")
    assert named == Path.cwd() / "logs" / "tiny-fsdp-lora_20261126-150211.out"
    assert named.read_text() == "START\n" and not log.exists()
    # kept: the flags did not parse (no name), a name that cannot name a file, the name it has, a log of that name
    assert run_log.rename(named, None) == named
    assert run_log.rename(named, "a/b") == named
    assert run_log.rename(named, "tiny-fsdp-lora") == named
    other = run_log.create("other", NOW).resolve()
    assert run_log.rename(other, "tiny-fsdp-lora") == other


def test_the_launchers_commands(tmp_path: Path) -> None:
    """`create` prints the new log; `rename` asks the run's interpreter for the run's name (the flags given after
    `--`), prints where the log is and says so."""
    python = executable(
        tmp_path / "python",
        '#!/usr/bin/env bash\n[[ "$*" == "-m model_utils.observe.run_name --lora_r 8" ]]\necho mine\n',
    )
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "dskit.launcher.run_log", *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    created = run("create", "unit")
    assert created.returncode == 0 and re.fullmatch(r"logs/unit_\d{8}-\d{6}\.out\n", created.stdout), created
    log = Path.cwd() / created.stdout.strip()
    renamed = run("rename", str(log), str(python), "--", "--lora_r", "8")
    named = log.with_name("mine_" + log.name.partition("_")[2])
    assert (renamed.stdout, renamed.stderr) == (f"{named}\n", f"Logging to logs/{named.name}\n")
    kept = run("rename", str(named), str(python), "--", "--bad")  # the flags do not parse: it keeps its name
    assert (kept.stdout, kept.stderr) == (f"{named}\n", f"Logging to logs/{named.name}\n")
    refused = run("create", "exp/1")
    assert refused.returncode == 2 and refused.stderr.startswith(
        "error: JOB_NAME 'exp/1' cannot name the log file"
    )

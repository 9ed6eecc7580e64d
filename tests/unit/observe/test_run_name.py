"""A run's name (the launcher's log) and id (metrics records, trackers), and the launcher's torch-free call."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from model_utils.config.arguments import parse_args
from model_utils.errors import ConfigError
from model_utils.observe import run_name


@pytest.mark.parametrize(
    ("flags", "name"),
    [
        ([], "tiny_qwen3-deepspeed"),
        (["--model", "Qwen/Qwen3-0.6B", "--backend", "fsdp"], "qwen3_0_6b-fsdp"),
        (["--lora_r", "8"], "tiny_qwen3-deepspeed-lora"),
        (["--backend", "fsdp", "--lora_r", "8", "--run_name", "mine"], "mine"),
    ],
)
def test_the_name_says_what_runs_unless_given(flags: list[str], name: str) -> None:
    assert run_name.run_name(parse_args(flags)) == name


def test_the_id_adds_the_start_time_and_slurm_job_unless_a_name_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert re.fullmatch(
        r"tiny_qwen3-fsdp-\d{8}-\d{6}", run_name.new_run_id(parse_args(["--backend", "fsdp"]))
    )
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert re.fullmatch(r"tiny_qwen3-deepspeed-\d{8}-\d{6}-job4711", run_name.new_run_id(parse_args([])))
    assert run_name.new_run_id(parse_args(["--run_name", "lr3e-4"])) == "lr3e-4"  # found again by that name


def test_a_resume_keeps_its_runs_id_and_says_so_when_run_name_differs() -> None:
    assert run_name.resume_mismatch(parse_args([]), "tiny_qwen3-deepspeed-20261126-091400") is None
    assert run_name.resume_mismatch(parse_args(["--run_name", "a"]), "a") is None
    warning = run_name.resume_mismatch(parse_args(["--run_name", "b"]), "a")
    assert warning is not None and "continues run a, which keeps its id" in warning
    assert "a new --checkpoint_dir starts run b" in warning


@pytest.mark.parametrize("bad", ["", "-x", "a/b", "two words", "x" * 101, "../up"])
def test_a_run_name_that_cannot_name_a_file_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"--run_name .* names files: use 1 to 100 letters"):
        parse_args([f"--run_name={bad}"])


def test_the_launchers_call_prints_the_name_without_importing_torch() -> None:
    probe = (
        "import sys, runpy; sys.argv = ['run_name', '--backend', 'fsdp', '--run_name', 'a.b']; "
        "code = 0\n"
        "try:\n    runpy.run_module('model_utils.observe.run_name', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print('torch' in sys.modules, code)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["a.b", "False", "0"]
    bad = subprocess.run(
        [sys.executable, "-m", "model_utils.observe.run_name", "--max_step", "x"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and bad.stdout == ""  # the launcher keeps its log's first name

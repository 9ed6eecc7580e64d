"""dskit.api's SLURM job watch against a stand-in `scontrol` on PATH (a shell script printing what SLURM prints):
the states a job passes through, a controller that is briefly unreachable, and a job already purged from it
(MinJobAge), whose exit status then comes from the log's END line. A real job through the API:
tests/slurm/test_slurm.py; a real local launch: tests/e2e/test_api.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dskit import api

SCRIPT = """#!/bin/bash
# Answers `scontrol -o show job ID` from the next line of {states} (the last line once the others are used).
n=$(cat {count} 2>/dev/null || echo 0); echo $((n + 1)) > {count}
line=$(sed -n "$((n + 1))p" {states}); [[ -n "$line" ]] || line=$(tail -n 1 {states})
case "$line" in
  gone) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;;
  busy) echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1 ;;
  *) echo "JobId=7 JobName=dskit JobState=${{line% *}} Reason=None ExitCode=${{line#* }} StdOut={log}" ;;
esac
"""


@pytest.fixture
def scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Sets the states the stand-in reports, one per poll; returns the log path it names."""
    bin_dir, states, log = tmp_path / "bin", tmp_path / "states", tmp_path / "job.out"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(SCRIPT.format(states=states, count=tmp_path / "count", log=log))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(api, "POLL_SECONDS", 0.01)

    def report(*lines: str) -> Path:
        states.write_text("\n".join(lines) + "\n")
        return log

    return report


def test_a_job_is_followed_through_a_requeue_to_its_end(scontrol) -> None:
    log = scontrol(
        "PENDING 0:0", "RUNNING 0:0", "REQUEUED 0:0", "PENDING 0:0", "RUNNING 0:0", "COMPLETED 0:0"
    )
    job = api._SlurmJob("7")
    assert job.log == log
    job.wait()
    assert (job.state, job.status([])) == ("COMPLETED", 0)


def test_a_busy_controller_is_asked_again_and_a_failed_job_keeps_its_exit_code(scontrol) -> None:
    scontrol("RUNNING 0:0", "busy", "busy", "FAILED 2:0")
    job = api._SlurmJob("7")
    job.wait()
    assert (job.state, job.status([])) == ("FAILED", 2)


def test_a_job_that_ended_other_than_failing_is_non_zero_even_with_exit_code_0(scontrol) -> None:
    scontrol("RUNNING 0:0", "TIMEOUT 0:0")
    job = api._SlurmJob("7")
    job.wait()
    assert (job.state, job.status([])) == ("TIMEOUT", 1)


def test_a_purged_job_ends_with_the_status_of_its_logs_last_end_line(scontrol) -> None:
    scontrol("RUNNING 0:0", "gone")
    job = api._SlurmJob("7")
    job.wait()
    assert job.state is None
    lines = ["END 2026-11-26T07:02:20+00:00 exit status 0: preempted, requeueing job 7", "START ...", "x"]
    assert job.status([*lines, "END 2026-11-26T07:02:50+00:00 exit status 2"]) == 2
    assert job.status(lines) == 0
    assert job.status(["no END line: the job died with its node"]) == 1

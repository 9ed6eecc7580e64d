"""dskit.api's SLURM job watch against a stand-in `scontrol` on PATH (a shell script printing what SLURM prints):
the states a job passes through, a controller that is briefly unreachable, and a job already purged from it
(MinJobAge), whose exit status then comes from the run summary train.sbatch's end wrote; the result and the error
read from the run's files, never its log. A real job through the API: tests/slurm/test_slurm.py; a real local
launch: tests/e2e/test_api.py."""

from __future__ import annotations

import json
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
    assert (job.state, job.status({})) == ("COMPLETED", 0)


def test_a_busy_controller_is_asked_again_and_a_failed_job_keeps_its_exit_code(scontrol) -> None:
    scontrol("RUNNING 0:0", "busy", "busy", "FAILED 2:0")
    job = api._SlurmJob("7")
    job.wait()
    assert (job.state, job.status({})) == ("FAILED", 2)


def test_a_job_that_ended_other_than_failing_is_non_zero_even_with_exit_code_0(scontrol) -> None:
    scontrol("RUNNING 0:0", "TIMEOUT 0:0")
    job = api._SlurmJob("7")
    job.wait()
    assert (job.state, job.status({})) == ("TIMEOUT", 1)


def test_a_purged_job_ends_with_the_status_its_end_wrote_into_the_summary(scontrol) -> None:
    scontrol("RUNNING 0:0", "gone")
    job = api._SlurmJob("7")
    job.wait()
    assert job.state is None
    assert job.status({"exit_status": 2}) == 2
    assert job.status({"exit_status": 0, "end": "done"}) == 0
    assert job.status({"end": "done"}) == 1  # no end of the job's own: the job died with its node


def test_the_result_is_the_run_summarys() -> None:
    summary = {
        "run_id": "tiny_qwen3-1", "metrics_file": "/r/logs/x.metrics.jsonl", "mlflow_run_id": "abc",
        "max_steps": 5, "step": 5, "train_loss": 6.5, "validation_step": 5, "validation_loss": 6.25,
        "checkpoint": "/r/checkpoints/tiny_qwen3-5steps", "end": "done", "end_step": 5,
    }  # fmt: skip
    result = api._result(summary, 1.0)
    assert (result.final_step, result.max_steps, result.train_loss, result.validation_loss) == (
        5,
        5,
        6.5,
        6.25,
    )
    assert (result.checkpoint, result.metrics_file) == (summary["checkpoint"], summary["metrics_file"])
    assert (result.run_id, result.mlflow_run_id, result.exported) == ("tiny_qwen3-1", "abc", None)
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()
    # A --validation_only run: the step of the model it measured; a run that stopped early: its last logged step.
    assert api._result({"end": "validated", "end_step": 24, "validation_loss": 2.0}, 1.0).final_step == 24
    assert api._result({**summary, "end": "preempted", "end_step": 7, "step": 6}, 1.0).final_step == 6
    assert api._result({}, 1.0) == api.TrainResult(None, None, None, None, None, None, None, None, None, 1.0)


def test_the_error_is_the_message_the_run_recorded_else_the_status_and_the_last_lines(tmp_path: Path) -> None:
    error_file = tmp_path / "error"
    lines = ["a", "b", "Traceback (most recent call last):", "Killed"]
    assert (
        api._error(error_file, lines, 137)
        == "training exited with status 137: b | Traceback (most recent call last): | Killed"
    )
    assert api._error(error_file, [], 1, "dskit eval") == "dskit eval exited with status 1: no output"
    error_file.write_text("unknown flag --max_step: did you mean --max_steps?\n")
    assert api._error(error_file, lines, 2) == "unknown flag --max_step: did you mean --max_steps?"

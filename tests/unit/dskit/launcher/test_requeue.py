"""launcher/requeue.py: train.sbatch's end, against stand-ins for scontrol, sbatch and squeue (a real cluster:
tests/slurm/test_slurm.py). The files it reads are what the ranks write (the trainer's stop reason,
launch_env.name_bad_hosts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dskit.launcher import requeue
from model_utils import launch_env
from support.recorded_commands import Commands

REPO = Path(__file__).resolve().parents[4]
HANG = "a rank stopped advancing (hang)"


class Job:
    """Job 12345 ("test") ending in tmp_path (its logs/ there), SLURM's commands stood in for."""

    def __init__(self, tmp_path: Path, excluded: str = "(null)") -> None:
        self.dir = tmp_path
        self.commands = Commands(tmp_path / "stand-ins")
        # `scontrol show job` names the job's excluded nodes; a job submitted with --wrap runs its command at once,
        # as /bin/sh, for which the job is pending by then (squeue).
        self.commands.add("scontrol", f'[[ "$1 $2" != "show job" ]] || echo "   ExcNodeList={excluded}"')
        self.commands.add("sbatch", 'for a in "$@"; do [[ "$a" != --wrap=* ]] || sh -c "${a#--wrap=}"; done')
        self.commands.add("squeue", "echo PENDING")
        self.stop_reason = tmp_path / "logs" / ".stop_reason_12345"
        self.hang_hosts = tmp_path / "logs" / ".hang_hosts_12345"
        self.stop_reason.parent.mkdir()

    def end(self, *args: str, restart: int = 0, **env: str) -> subprocess.CompletedProcess[str]:
        environ = {
            "PATH": self.commands.path,
            "PYTHONPATH": str(REPO / "src"),
            "SLURM_JOB_ID": "12345",
            "SLURM_JOB_NAME": "test",
            "SLURM_RESTART_COUNT": str(restart),
            launch_env.STOP_REASON_FILE: str(self.stop_reason),
            launch_env.HANG_HOSTS_FILE: str(self.hang_hosts),
            **env,
        }
        return subprocess.run(
            [sys.executable, "-m", "dskit.launcher.requeue", *args],
            cwd=self.dir, env=environ, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def scontrol(self) -> list[list[str]]:
        return self.commands.calls("scontrol")


def end_lines(out: str) -> list[str]:
    return re.findall(r"^END \S+ exit status (.*)$", out, re.M)


def test_a_hung_run_is_requeued_without_the_stuck_host_at_most_max_hang_requeues_times(
    tmp_path: Path,
) -> None:
    """The watchdog ended the ranks (exit status 75) naming n2: the job is requeued without n2, keeping the hosts
    excluded before; once max_hang_requeues are spent it ends with 75 and says why."""
    job = Job(tmp_path, excluded="n7")
    # an earlier job's count with this job's id (a reset cluster): not this job's
    (tmp_path / "logs" / ".hang_requeues_12345").write_text("5\n")
    job.hang_hosts.write_text(f"n2 {HANG}\n")
    first = job.end("--max_hang_requeues", "1", "75", "0")
    assert first.returncode == 0, first.stdout + first.stderr
    # ExcNodeList changes only while the job is pending: requeued held, then the helper job waits for PENDING,
    # sets the list and releases it.
    (helper,) = job.commands.calls("sbatch")
    assert helper[:6] == [
        "--quiet",
        "--job-name=test-exclude",
        "--nodes=1",
        "--ntasks=1",
        "--time=5",
        "--output=/dev/null",
    ]
    assert job.commands.calls("squeue") == [["-h", "-j", "12345", "-o", "%T"]]
    calls = job.scontrol()
    assert calls.index(["update", "JobId=12345", "ExcNodeList=n7,n2"]) < calls.index(["release", "12345"])
    assert calls[-1] == ["requeuehold", "12345"]  # last: it ends the batch script
    assert end_lines(first.stdout) == [
        "75: n2: a rank stopped advancing (hang), requeueing job 12345 without n7,n2 (hang requeue 1 of 1; resumes "
        "from the last checkpoint; held until the helper job test-exclude sets that: if it stays held, scontrol "
        "update JobId=12345 ExcNodeList=n7,n2 && scontrol release 12345)"
    ]
    assert not job.hang_hosts.exists()  # read once, then removed
    assert not any(c[0] == "update" and c[1].startswith("NodeName=") for c in calls)  # no drain unless asked
    # the requeued job (SLURM_RESTART_COUNT 1) hangs elsewhere: its one requeue is spent
    job.hang_hosts.write_text(f"n3 {HANG}\n")
    again = job.end("--max_hang_requeues", "1", "75", "0", restart=1)
    assert again.returncode == 75, again.stdout + again.stderr
    assert again.stdout.splitlines() == [
        "n3: a rank stopped advancing (hang) after 1 hang requeues (max_hang_requeues 1): not requeueing",
        again.stdout.splitlines()[-1],
    ]
    assert end_lines(again.stdout) == ["75"]
    assert sum(c[0] == "requeuehold" for c in job.scontrol()) == 1


def test_the_hosts_of_every_named_line_are_excluded_once_and_said_why() -> None:
    named = f"n2 {HANG}\nn1   failed the health gate\n\nn2 {HANG}\n \n"
    assert requeue.bad_hosts(named) == (["n1", "n2"], f"n1: failed the health gate; n2: {HANG}")
    assert requeue.bad_hosts(" \n") == ([], "")


def test_a_hung_host_is_drained_when_allowed(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.hang_hosts.write_text(f"n2 {HANG}\n")
    proc = job.end("--max_hang_requeues", "2", "--drain_hung_nodes", "75", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = job.scontrol()
    drain = ["update", "NodeName=n2", "State=DRAIN", f"Reason=dskit: n2: {HANG} (job 12345)"]
    assert calls.index(drain) < calls.index(["requeuehold", "12345"])


def test_a_drain_without_operator_rights_says_so_and_still_excludes(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.commands.add("scontrol", '[[ "$1 $2" != "update NodeName=n2" ]] || exit 1')
    job.hang_hosts.write_text(f"n2 {HANG}\n")
    proc = job.end("--max_hang_requeues", "2", "--drain_hung_nodes", "75", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (
        "WARNING: could not drain n2 (drain_hung_nodes needs SLURM operator rights): excluding them only"
        in proc.stdout
    )
    assert ["update", "JobId=12345", "ExcNodeList=n2"] in job.scontrol()


def test_the_node_that_failed_the_health_gate_is_excluded_and_75_without_a_host_is_not_requeued(
    tmp_path: Path,
) -> None:
    """The health gate's failing node (launch/health_gate.py: exit status 75, its host named with why) takes the
    watchdog's path: requeued without it, the END line saying why; 75 without a named host (a slow all-reduce
    across nodes) is the job's status."""
    job = Job(tmp_path)
    job.hang_hosts.write_text("n2 failed the health gate\n")
    proc = job.end("--max_hang_requeues", "2", "75", "0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ["update", "JobId=12345", "ExcNodeList=n2"] in job.scontrol()  # by the helper job
    (line,) = end_lines(proc.stdout)
    assert line.startswith(
        "75: n2: failed the health gate, requeueing job 12345 without n2 (hang requeue 1 of 2"
    )
    unnamed = Job(tmp_path / "unnamed")
    unnamed.hang_hosts.write_text(" \n")
    slow = unnamed.end("--max_hang_requeues", "2", "75", "0")
    assert slow.returncode == 75 and end_lines(slow.stdout) == ["75"], slow.stdout + slow.stderr
    assert unnamed.scontrol() == [] and not unnamed.hang_hosts.exists()
    never = Job(tmp_path / "never")  # max_hang_requeues 0
    never.hang_hosts.write_text("n2 failed the health gate\n")
    assert never.end("75", "0").returncode == 75 and never.scontrol() == []


@pytest.mark.parametrize(
    ("status", "preempted", "reason", "said"),
    [
        ("0", "1", "", "0: preempted, requeueing job 12345 (resumes from the last checkpoint)"),
        ("0", "0", "walltime", "0: walltime, requeueing job 12345 (resumes from the last checkpoint)"),
        ("none", "1", "", "0: preempted, requeueing job 12345 (resumes from the last checkpoint)"),
    ],
    ids=["USR1", "time limit", "USR1 before the ranks started"],
)
def test_a_preempted_run_or_one_stopped_for_the_time_limit_requeues(
    tmp_path: Path, status: str, preempted: str, reason: str, said: str
) -> None:
    """The ranks saved and stopped (USR1, or the trainer before the job's time limit): the job requeues itself and
    resumes from that checkpoint."""
    job = Job(tmp_path)
    if reason:
        job.stop_reason.write_text(f"{reason}\n")
    summary = tmp_path / "summary.json"
    proc = job.end("--max_hang_requeues", "2", status, preempted, **{launch_env.RUN_SUMMARY: str(summary)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert end_lines(proc.stdout) == [said]
    assert not summary.exists()  # the job goes on: it has no exit status yet
    assert job.scontrol() == [["requeue", "12345"]]
    assert not job.stop_reason.exists()  # read once, then removed
    assert ("USR1 came before the ranks started: not starting them" in proc.stdout) == (status == "none")


@pytest.mark.parametrize("status", ["0", "1", "2"])
def test_a_finished_or_failed_run_ends_with_its_status(tmp_path: Path, status: str) -> None:
    job = Job(tmp_path)
    job.stop_reason.write_text("done\n")  # a reason other than the time limit: nothing to requeue
    summary = tmp_path / "summary.json"
    summary.write_text('{"run_id": "r", "end": "done"}')  # the ranks' part
    proc = job.end("--max_hang_requeues", "2", status, "0", **{launch_env.RUN_SUMMARY: str(summary)})
    assert proc.returncode == int(status) and end_lines(proc.stdout) == [status], proc.stdout + proc.stderr
    assert json.loads(summary.read_text()) == {"run_id": "r", "end": "done", "exit_status": int(status)}
    assert job.scontrol() == []


def test_an_unexpected_host_list_is_refused_before_anything_changes(tmp_path: Path) -> None:
    job = Job(tmp_path, excluded="n[1-2];rm")
    job.hang_hosts.write_text(f"n2 {HANG}\n")
    proc = job.end("--max_hang_requeues", "2", "75", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: unexpected host list 'n[1-2];rm,n2'"
    assert job.commands.calls("sbatch") == [] and job.scontrol() == [["show", "job", "12345"]]

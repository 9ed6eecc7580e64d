"""train.sbatch's end, once the ranks have: requeue the job or not, and the log's END line.

    python3 -m dskit.launcher.requeue [--max_hang_requeues N] [--drain_hung_nodes] STATUS PREEMPTED

STATUS is the ranks' (srun's) exit status (`none`: they were not started, USR1 came first), PREEMPTED 1 once USR1 came (SLURM's before the time limit, or
`scancel --signal=USR1 --batch`), else 0. Requeued (`scontrol requeue`, resuming from the last checkpoint): a run
stopped by USR1, or one the trainer stopped early for the time limit (it writes `walltime` into
DSKIT_STOP_REASON_FILE). A hang or a node that failed the health gate (STATUS 75, the ranks naming the hosts in
DSKIT_HANG_HOSTS_FILE, a line `HOST WHY` each: launch_env.name_bad_hosts) is requeued without those hosts, which
stay excluded in later requeues, at most --max_hang_requeues times in the job's life; a run that fails so again on
other hosts then stops, saying why. SLURM changes a job's ExcNodeList only while it is pending, and a requeued job may start again at once on the
node it left: so the job is requeued held, and a one-task helper job sets the list once it is pending, then
releases it. --drain_hung_nodes also drains the hosts (SLURM operator rights). Its exit status is the job's: 0 for
a requeue (which ends this script: the END line comes first), else STATUS.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from dskit.launcher import check, main
from model_utils import launch_env
from model_utils.errors import CommandParser, ConfigError
from model_utils.observe import run_summary
from model_utils.observe.watchdog import HANG_EXIT

WALLTIME = "walltime"  # the trainer's stop reason for the time limit (launch/walltime.py)
HOST_LIST = re.compile(r"[A-Za-z0-9._,-]+(\[[0-9,-]+\])?[A-Za-z0-9._,-]*")
# The helper job: waits (at most 10 minutes) for the job to be pending, sets its ExcNodeList, releases it.
HELPER = (
    'for _ in $(seq 600); do [ "$(squeue -h -j {job} -o %T)" = PENDING ] && break; sleep 1; done; '
    "scontrol update JobId={job} ExcNodeList={exclude} && scontrol release {job}"
)


def end_line(status: int, why: str = "") -> str:
    return (
        f"END {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} exit status {status}{why}"
    )


def _take(path: str | None) -> str:
    """A file's text, the file removed: each run reads what its ranks wrote once."""
    if not path:
        return ""
    try:
        text = Path(path).read_text()
    except OSError:
        return ""
    Path(path).unlink(missing_ok=True)
    return text


def bad_hosts(named: str) -> tuple[list[str], str]:
    """The hosts named (lines `HOST WHY`), and why, as the END line says it: `n2: a rank stopped advancing`."""
    lines = sorted({" ".join(line.split()) for line in named.splitlines() if line.strip()})
    hosts = sorted({line.partition(" ")[0] for line in lines})
    return hosts, "; ".join(
        f"{host}: {why}".rstrip() for host, _, why in (line.partition(" ") for line in lines)
    )


def _scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["scontrol", *args], capture_output=True, text=True, check=False)


def excluded(job: str) -> list[str]:
    """The job's ExcNodeList (SLURM's compact form), empty when there is none."""
    match = re.search(r"ExcNodeList=(\S*)", _scontrol("show", "job", job).stdout)
    value = match.group(1) if match else ""
    return [] if value in ("", "(null)") else [value]


def finish(
    status: int | None, preempted: bool, max_hang_requeues: int, drain: bool, environ: Mapping[str, str]
) -> int:
    if status is None:
        print("USR1 came before the ranks started: not starting them")
        status = 0
    job = environ["SLURM_JOB_ID"]
    stop_reason = _take(environ.get(launch_env.STOP_REASON_FILE)).strip()
    if status == 0 and (preempted or stop_reason == WALLTIME):
        why = "preempted" if preempted else stop_reason
        print(end_line(0, f": {why}, requeueing job {job} (resumes from the last checkpoint)"), flush=True)
        _scontrol("requeue", job)
        return 0
    hosts, why = bad_hosts(_take(environ.get(launch_env.HANG_HOSTS_FILE)))
    if status == HANG_EXIT and hosts:
        # This job's hang requeues so far; a first run's file is an earlier job's with this id (a reset cluster).
        count_file = Path("logs") / f".hang_requeues_{job}"
        first_run = environ.get("SLURM_RESTART_COUNT", "0") == "0"
        done = 0 if first_run or not count_file.is_file() else int(count_file.read_text() or 0)
        if done < max_hang_requeues:
            exclude = ",".join([*excluded(job), *hosts])
            if not HOST_LIST.fullmatch(exclude):
                raise ConfigError(f"unexpected host list '{exclude}'")
            count_file.write_text(f"{done + 1}\n")
            if drain:
                drain_hosts(hosts, f"dskit: {why} (job {job})")
            requeue_without(exclude, why, f"hang requeue {done + 1} of {max_hang_requeues}", environ)
            return 0
        print(f"{why} after {done} hang requeues (max_hang_requeues {max_hang_requeues}): not requeueing")
    print(end_line(status), flush=True)
    run_summary.update({"exit_status": status})  # for dskit.api, when SLURM has forgotten the job
    return status


def drain_hosts(hosts: list[str], reason: str) -> None:
    """No other job gets them until an administrator resumes them (SLURM operator rights; else they are only
    excluded)."""
    nodes = ",".join(hosts)
    if _scontrol("update", f"NodeName={nodes}", "State=DRAIN", f"Reason={reason}").returncode:
        print(
            f"WARNING: could not drain {nodes} (drain_hung_nodes needs SLURM operator rights): excluding them only"
        )


def requeue_without(exclude: str, why: str, count: str, environ: Mapping[str, str]) -> None:
    """The job requeued held, the helper job submitted that sets its ExcNodeList (`exclude`) and releases it; the
    END line says why and which hang requeue (`count`) this is."""
    job, name = environ["SLURM_JOB_ID"], environ["SLURM_JOB_NAME"]
    helper = [f"--job-name={name}-exclude", "--nodes=1", "--ntasks=1", "--time=5", "--output=/dev/null"]
    for option, variable in (("--partition", "SLURM_JOB_PARTITION"), ("--account", "SLURM_JOB_ACCOUNT")):
        if environ.get(variable):
            helper.append(f"{option}={environ[variable]}")
    check(["sbatch", "--quiet", *helper, f"--wrap={HELPER.format(job=job, exclude=exclude)}"])
    print(
        end_line(
            HANG_EXIT,
            f": {why}, requeueing job {job} without {exclude} ({count}; resumes from the last checkpoint; held until "
            f"the helper job {name}-exclude sets that: if it stays held, scontrol update JobId={job} "
            f"ExcNodeList={exclude} && scontrol release {job})",
        ),
        flush=True,
    )
    _scontrol("requeuehold", job)  # it ends this script: the END line came first


def _main(argv: list[str]) -> int:
    parser = CommandParser(prog="python3 -m dskit.launcher.requeue")
    parser.add_argument("--max_hang_requeues", type=int, default=0)
    parser.add_argument("--drain_hung_nodes", action="store_true")
    parser.add_argument("status", help="the ranks' exit status, none where they were not started")
    parser.add_argument(
        "preempted", type=int, choices=(0, 1), help="1: USR1 came, the ranks were asked to stop"
    )
    args: argparse.Namespace = parser.parse_args(argv)
    status = None if args.status == "none" else int(args.status)
    return finish(status, args.preempted == 1, args.max_hang_requeues, args.drain_hung_nodes, os.environ)


if __name__ == "__main__":
    main(_main)

"""Every environment variable that passes between the launchers (train.sbatch, train-singlenode.sh) and the
training ranks. One place, so a name cannot drift between the shell and Python."""

from __future__ import annotations

import os

LOG_FILE = "DSKIT_LOG_FILE"  # the run's log: the metrics file goes next to it
STOP_REASON_FILE = "DSKIT_STOP_REASON_FILE"  # train.sbatch: why the ranks stopped early (it then requeues)
# The message of the first `error:` line (observe.log.error_line) of a rank on this host goes here too: the
# SageMaker entry makes it the job's FailureReason, dskit.api the message of the error it raises.
ERROR_FILE = "DSKIT_ERROR_FILE"
# The run's outcome as one JSON object (observe/run_summary.py), where the tool that started it reads it (dskit.api).
RUN_SUMMARY = "DSKIT_RUN_SUMMARY"
TTY = "DSKIT_TTY"  # the launcher's terminal: rank 0 draws its progress bar there, never into the log
# When the launcher started (Unix seconds; the rendered launchers' first line, the SageMaker entry's start): where
# an attempt's paid time begins in the run's goodput ledger (loop/observers/ledger.py).
LAUNCHED_AT = "DSKIT_LAUNCHED_AT"
# A file in which rank 0 names the run's ledger, for launch/supervise.py to append the attempt's exit to it once
# torchrun is done (the ranks' teardown is paid time too).
LEDGER_POINTER = "DSKIT_LEDGER_POINTER"
# What the hosts are, for `dskit cost`, where they cannot tell themselves.
INSTANCE_TYPE = "DSKIT_INSTANCE_TYPE"
# The launchers make the ranks offline (HF_HUB_OFFLINE=1) after the preflight fetched the model; this keeps what
# the caller had set (empty: unset), for what goes to the hub after training (loop/observers/hub_push.py).
CALLER_HF_HUB_OFFLINE = "DSKIT_CALLER_HF_HUB_OFFLINE"
# train-singlenode.sh: the dir it was started from (it changes to the kit's root): the relative paths among the
# flags are taken from there (config/arguments.py).
CALLER_DIR = "DSKIT_CALLER_DIR"
SINGLENODE_LOGGED = "DSKIT_SINGLENODE_LOGGED"  # train-singlenode.sh re-executed itself under its log tee
# The launch's own id: its preflight takes the checkpoint dir's lease with it, and its rank 0 adopts that lease
# (checkpoint/lease.py).
LEASE_TOKEN = "DSKIT_LEASE_TOKEN"
FAULT_INJECT = "DSKIT_FAULT_INJECT"  # tests only: a rank SIGKILLs itself at a named point of a save
# train.sbatch: the hosts to requeue the job without, one a line with why (name_bad_hosts): the hang watchdog's
# stuck ranks' hosts, the health gate's failing nodes.
HANG_HOSTS_FILE = "DSKIT_HANG_HOSTS_FILE"
# The hang watchdog's heartbeat files of a host's ranks (observe/watchdog.py; default: under the temp dir).
WATCHDOG_DIR = "DSKIT_WATCHDOG_DIR"
# The launcher's temporary dir (launch/supervise.py, scratch.py): the ranks' heartbeats go in it.
LAUNCH_DIR = "DSKIT_LAUNCH_DIR"
# The SageMaker entry (dskit.sagemaker.entry), set in the job's environment by `dskit sagemaker submit`:
# the root of SageMaker's /opt/ml tree (another dir runs the contract anywhere); uv: `uv sync --frozen` in the
# job, image: the image holds the environment; ranks per instance without GPUs (gloo); the first host's port.
SAGEMAKER_BASE = "DSKIT_SM_BASE"
SAGEMAKER_SETUP = "DSKIT_SM_SETUP"
SAGEMAKER_CPU_RANKS = "DSKIT_SM_CPU_RANKS"
SAGEMAKER_MASTER_PORT = "DSKIT_SM_MASTER_PORT"
# Seconds from SIGTERM until the entry ends ranks that have not stopped (SageMaker's SIGKILL follows at 120 s).
SAGEMAKER_STOP_GRACE = "DSKIT_SM_STOP_GRACE_S"


def name_bad_hosts(hosts: list[str], why: str) -> None:
    """Name `hosts` to train.sbatch, which requeues the job without them (on the ranks' exit status 75): a line
    `HOST WHY` each, appended (a shared filesystem: every node's writer, one file). Nothing where the launcher set
    no file (./train-singlenode.sh, a bare torchrun)."""
    path = os.environ.get(HANG_HOSTS_FILE)
    if path and hosts:
        with open(path, "a") as f:
            f.write("".join(f"{host} {why}\n" for host in sorted(set(hosts))))

"""launch/supervise.py: torchrun that ends a failed run with one line naming the rank, its host and why. The
line from torchrun's failures, and a real 2-rank torchrun of a tiny script (no model) whose rank 1 writes the
kit's error line and exits 2. A rank SIGKILLed in a real training run through the launcher:
tests/e2e/test_rank_failure.py."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from model_utils.launch import supervise
from model_utils.observe import watchdog
from support.processes import ended_pid
from support.torchrun import ENV, REPO


def failure(local_rank: int, pid: int, exitcode: int) -> ProcessFailure:
    return ProcessFailure(local_rank=local_rank, pid=pid, exitcode=exitcode, error_file="<N/A>")


def test_the_line_names_the_first_failed_rank_its_host_and_how_it_ended() -> None:
    killed = {1: failure(1, 4242, -signal.SIGKILL)}
    assert supervise.summary(killed, "node7", None) == (
        "error: rank 1 (local rank 1, pid 4242) on node7 was killed by SIGKILL (signal 9); torchrun stopped the "
        "other ranks"
    )
    written = "dataset path /x does not exist: fix the path"
    assert supervise.summary({3: failure(1, 7, 2)}, "n2", written) == (
        "error: rank 3 (local rank 1, pid 7) on n2 exited with status 2: dataset path /x does not exist: fix the path"
    )
    # torchrun's SIGTERM to the other ranks lands in the same second: not the rank that failed.
    stopped = {0: failure(0, 1, -signal.SIGTERM), 1: failure(1, 2, -signal.SIGKILL)}
    stopped[0].timestamp = stopped[1].timestamp
    assert supervise.summary(stopped, "h", None) == (
        "error: rank 1 (local rank 1, pid 2) on h was killed by SIGKILL (signal 9); torchrun stopped the other ranks"
    )
    two = {0: failure(0, 1, 1), 1: failure(1, 2, 1)}
    two[1].timestamp = two[0].timestamp + 5  # rank 0 failed first
    assert supervise.summary(two, "h", None) == (
        "error: rank 0 (local rank 0, pid 1) on h exited with status 1 (1 more rank failed after it)"
    )
    alone = {2: failure(0, 9, -signal.SIGTERM)}  # a SIGTERM from outside: still named
    assert supervise.summary(alone, "h", None).startswith(
        "error: rank 2 (local rank 0, pid 9) on h was killed by SIGTERM"
    )


def test_a_hang_ends_with_the_watchdogs_line_and_its_status() -> None:
    """The watchdog's rank exits HANG_EXIT after its line; torchrun then stops the frozen one: the line is the
    watchdog's (it names the stuck rank, not the rank that reported it) and the status is the hang's."""
    ended = {0: failure(0, 11, watchdog.HANG_EXIT), 1: failure(1, 12, -signal.SIGTERM)}
    message = "hang: rank 1 (pid 12) on n4 stopped advancing in compute of step 9: no heartbeat for 31 s"
    assert supervise.hung(ended) and not supervise.hung({1: failure(1, 12, 1)})
    assert supervise.summary(ended, "n4", message) == f"error: {message}"
    assert supervise.summary(ended, "n4", None).startswith(
        "error: rank 0 (local rank 0, pid 11) on n4 exited"
    )


RANK_SCRIPT = """
import os, sys, time
from pathlib import Path
from model_utils.observe.log import error_line
pointer = Path(os.environ["DSKIT_LEDGER_POINTER"])
if os.environ["RANK"] == "0":  # what the ledger observer does at the loop's start: name the run's ledger
    from model_utils.observe import watchdog
    beats = watchdog.heartbeat_dir()  # a rank killed while it watched: its heartbeat left behind
    beats.mkdir()
    (beats / "rank-0.json").write_text("{}")
    print(f"heartbeats in {beats}", flush=True)
    pointer.with_suffix(".tmp").write_text(str(Path("ledger.jsonl").resolve()))
    pointer.with_suffix(".tmp").rename(pointer)
if os.environ["RANK"] == "1":
    # Fail only once rank 0 has named the ledger: torchrun stops rank 0 the moment rank 1 exits.
    while not pointer.exists():
        time.sleep(0.05)
    error_line("dataset path /nope does not exist: fix --dataset")
    sys.exit(2)
"""


def test_a_real_torchrun_ends_with_the_failed_ranks_line(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    temp = tmp_path / "tmp"  # the launch's temp dir: what it leaves there is seen
    temp.mkdir()
    owner = f"{socket.gethostname()}-{os.getuid()}"
    ended = ended_pid()
    killed_launch = temp / f"dskit-launch-{owner}-{ended}-x1"  # its launcher is gone
    killed_ranks = temp / f"dskit-watchdog-{owner}-{ended}-29500-0"  # under accelerate, say
    live_launch = temp / f"dskit-launch-{owner}-{os.getpid()}-x2"  # this process runs
    other_host = temp / f"dskit-launch-elsewhere-{os.getuid()}-{ended}-x3"
    for directory in (killed_launch, killed_ranks, live_launch, other_host):
        directory.mkdir()
    env = {k: v for k, v in ENV.items() if k != "DSKIT_ERROR_FILE"}
    env.update(PYTHONPATH=str(REPO / "src"), TMPDIR=str(temp))
    proc = subprocess.run(
        [sys.executable, "-m", "model_utils.launch.supervise", "--standalone", "--nproc_per_node=2", str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: rank 1 (local rank 1, pid "), proc.stderr
    assert last.endswith(
        f") on {socket.gethostname()} exited with status 2: dataset path /nope does not exist: fix --dataset"
    )
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr
    # The attempt's end in the run's ledger, after torchrun: its status and a time after every rank ended.
    (record,) = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert record["event"] == "exit" and record["status"] == 1 and record["t"] <= time.time()
    assert sorted(tmp_path.iterdir()) == sorted(
        [script, temp, tmp_path / "ledger.jsonl"]
    )  # nothing else left behind
    (beats,) = re.findall(r"heartbeats in (\S+)", proc.stdout)
    assert Path(beats).parent.name.startswith(f"dskit-launch-{owner}-")  # in the launcher's dir
    # Of the temp dir: the killed launcher's and ranks' dirs are removed; the launch's own dir (the rank's
    # heartbeats, the error file, the ledger pointer, torchrun's log dir: no torchelastic_* dir) is gone with it.
    assert sorted(temp.iterdir()) == sorted([live_launch, other_host])

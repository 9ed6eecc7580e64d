"""A rank killed in a real run through `./train-singlenode.sh`: the job ends at once, and its last line before
END says which rank died, where and how (launch/supervise.py), instead of torchrun's ChildFailedError traceback.
2 CPU ranks of the tiny default model; rank 1 gets SIGKILL as soon as it exists (a rank dying at any point ends
the run the same way; killing it early spares the suite the ranks' start-up). And an error every rank raises
(a flag, a config) is printed by rank 0 before torchrun's close ends it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.singlenode import launch_and_interrupt, rank_pids

pytestmark = [pytest.mark.e2e, pytest.mark.launcher]

READY = re.compile(r"^Ranks started: ")  # the launcher has started torchrun: rank 1 follows within seconds


def test_a_killed_rank_ends_the_job_with_one_line_naming_it(tmp_path: Path) -> None:
    job = f"rank-kill-test-{os.getpid()}"
    victims: list[int] = []

    def kill_rank_1(_group: int) -> None:
        deadline = time.monotonic() + 60
        while (victim := rank_pids(job).get(1)) is None:
            assert time.monotonic() < deadline, "rank 1 did not start"
            time.sleep(0.05)
        os.kill(victim, signal.SIGKILL)
        victims.append(victim)

    try:
        status, output, seconds = launch_and_interrupt(tmp_path, job, kill_rank_1, when=READY)
    finally:
        for pid in rank_pids(job).values():  # a failed test's ranks (torchrun runs in a session of its own)
            os.kill(pid, signal.SIGKILL)
    assert status == 1, output[-4000:]
    lines = output.splitlines()
    tail = lines[next(i for i, line in enumerate(lines) if READY.search(line)) + 1 :]
    print(f"killed rank 1: exit after {seconds:.1f} s, {len(tail)} lines after the kill")
    assert re.fullmatch(r"END \S+ exit status 1", tail[-1]), output[-4000:]
    assert tail[-2] == (
        f"error: rank 1 (local rank 1, pid {victims[0]}) on {socket.gethostname()} was killed by SIGKILL (signal 9); "
        "torchrun stopped the other ranks"
    ), output[-4000:]
    assert "ChildFailedError" not in output and "Root Cause" not in output, output[-4000:]
    assert seconds < 30, f"{seconds:.0f} s from the kill to the exit"


RANK_REFUSES = """\
import os, sys, time
from model_utils.observe import log
log.LINGER_S = float(sys.argv[1])
if os.environ["RANK"] == "0":
    time.sleep(1.5)  # rank 0 a little behind, as under load
log.error_line("the flag is wrong: fix it")
log.let_rank0_print()
sys.exit(2)
"""


@pytest.mark.parametrize("linger", [0.0, 60.0])
def test_an_error_every_rank_raises_is_printed_by_rank_0_before_torchrun_ends_it(
    tmp_path: Path, linger: float
) -> None:
    """Under real torchrun, the first rank to fail has the others ended (SIGTERM): without lingering, rank 1 ends
    first and rank 0's line is lost; with it, rank 0 prints, ends, and torchrun ends rank 1 at once."""
    script = tmp_path / "refuse.py"
    script.write_text(RANK_REFUSES)
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
    }
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--monitor_interval", "0.1",
         f"--log-dir={tmp_path / 'torchrun'}", str(script), str(linger)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    took = time.monotonic() - started
    printed = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0
    if linger:
        assert printed == ["error: the flag is wrong: fix it"], proc.stderr[-3000:]
        assert took < linger, took  # rank 1 ended by torchrun, not by its wait
    else:
        assert printed == [], proc.stderr[-3000:]

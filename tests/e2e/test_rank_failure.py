"""A rank killed in a real run through `./train-singlenode.sh`: the job ends at once, and its last line before
END says which rank died, where and how (launch/supervise.py), instead of torchrun's ChildFailedError traceback.
2 CPU ranks of the tiny default model; rank 1 gets SIGKILL as soon as it exists (a rank dying at any point ends
the run the same way; killing it early spares the suite the ranks' start-up)."""

from __future__ import annotations

import os
import re
import signal
import socket
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
